"""Serving the fleet, on learner rank 0: who is connected, what each actor may generate, what arrived.

The hub owns the actor registry, admission control (the staleness bound), the ledger of every
prompt's fate, the batch buffer, evaluation rounds and the operator's live controls. state.py holds
that logic with no I/O, composed of registry.py (the actors), groups.py (rollout groups admitted or
refused), dispatch.py (grants) and updates.py (the policy version, the bound, the buffer); its records
are in records.py. server.py is the learner's handle on it; thread.py runs it on its own thread behind
the ZeroMQ socket and CURVE gate.
"""
