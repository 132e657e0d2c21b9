"""Serving the fleet, on learner rank 0: who is connected, what each actor may generate, what arrived.

The hub owns the actor registry, admission control (the staleness bound), the ledger of every prompt's fate, the
batch buffer, evaluation rounds and the operator's live controls. Its decisions are core/, with no I/O (the
sans-IO core: a message and the time in, the messages to send out). The shell around it:

    server.py       Hub: the learner's handle (the training thread's API, under the hub's lock)
    thread.py       the hub thread: its zmq_poll loop, the ROUTER socket, disconnects, housekeeping
    gatekeeper.py   the CURVE gate (ZAP): which client keys are admitted
"""
