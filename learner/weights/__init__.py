"""Fresh weights from learner rank 0 to every actor, over a weight group whose membership and backend are planned
per epoch (protocol/weights.py on the wire).

    source.py       where the weights are read, whatever the ZeRO stage: in place, or gathered into a snapshot
    buckets.py      the memory each bucket is broadcast from (live parameters, or a reused copy)
    sync.py         WeightSender: the training thread's API (sync, start, wait, guard) and the fleet's listener
    serving.py      the serving thread: whom next, retries        attempts.py   one attempt's I/O
    state.py        every decision, with no I/O (membership.py: who is on probation), records.py: its records
    fleet.py        Fleet: what the sender needs of the hub, and the lock rule between the two
"""
