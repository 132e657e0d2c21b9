"""Serving the fleet, on learner rank 0: who is connected, what each actor may generate, what arrived.

The hub owns the actor registry, admission control (the staleness bound), the ledger of every
prompt's fate, the batch buffer, evaluation rounds and the operator's live controls. state.py holds
that logic with no I/O (its records in records.py); server.py runs it on its own thread behind the
ZeroMQ socket and CURVE gate.
"""
