"""The hub's decisions, with no I/O: no socket, no event loop, no clock and no lock of their own. The caller (the
hub thread, learner/hub/thread.py, or the training thread through learner/hub/server.py) passes the time and
holds the hub's lock; each rule is unit-tested by calling it (tests/unit/test_hub_state.py and friends).

    state.py        HubState: routes each actor message to its part, holds what the parts share
    registry.py     the live actors: registration, removal, silent-actor expiry
    groups.py       a rollout group admitted or refused (checks.py: what it must satisfy; quarantine.py: strikes)
    dispatch.py     work and eval grants, as far as admission control allows
    updates.py      the training thread's side: policy version, staleness bound, batch buffer
    ledger.py       every prompt's fate: pending, granted, received, trained
    evaluation.py   eval rounds          control.py   the operator's live settings and status reply
    records.py      the plain records they share
"""
