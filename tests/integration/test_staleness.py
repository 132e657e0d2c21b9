"""The staleness bound is a hard invariant: no sample with u - v > k is ever trained on.

The hub runs for real (its thread, its ROUTER socket, the codec); three scripted
actors speak the real protocol: a fast one, a slow one whose leases expire (its
late groups arrive stale), and a liar whose every other group claims a version
older than the bound allows.
"""

import pytest
from scripted_actor import ScriptedActor

from learner import staleness as st


def test_admission_capacity_rule():
    # idle at version 5, k = 1: slots for updates 5 and 6
    assert st.admission_capacity(5, False, 1, prompts_per_step=4, outstanding=3) == 5
    # while update 5 runs its batch is taken: only update 6's slot is left
    assert st.admission_capacity(5, True, 1, 4, outstanding=3) == 1
    # k = 0: synchronous, nothing is granted during an update
    assert st.admission_capacity(5, True, 0, 4, outstanding=0) == 0
    assert st.admission_capacity(5, False, 0, 4, outstanding=4) == 0
    assert st.min_grant_version(5) == 5
    assert st.admissible(7, 4, 3) and not st.admissible(7, 3, 3)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_no_sample_beyond_the_bound_is_trained(k, start_hub):
    hub = start_hub(
        f"staleness.max_staleness={k}",
        "train.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        "staleness.lease_s=0.3",
        "data.epochs=1000",
    )
    addr = hub.cfg.hub.bind
    actors = [
        ScriptedActor(addr, "fast", 2, delay_s=0.02, seed=0).start(),
        ScriptedActor(addr, "slow", 2, delay_s=0.8, seed=1).start(),
        ScriptedActor(addr, "liar", 2, delay_s=0.02, seed=2, lie_every=2, lie_by=k + 1).start(),
    ]
    staleness_seen = []
    version = 0
    try:
        for _ in range(15):
            batch = hub.take_batch(4, timeout_s=60)
            for item in batch:
                staleness_seen.append(version - item.group.version_min)
            version += 1
            hub.finish_update(version, [item.key for item in batch])
            for a in actors:
                a.target_version = version
        snap = hub.snapshot()
    finally:
        for a in actors:
            a.stop.set()
    assert max(staleness_seen) <= k
    assert snap["hub/dropped_stale"] > 0, "the liar's stale groups must have reached the check"
    assert snap["ledger/trained"] == 15 * 4
    hub.ledger.check()
    # every dropped group went back to the queue: counted, not lost
    assert snap["ledger/requeued_stale"] == snap["hub/dropped_stale"]
    if k == 3:
        assert max(staleness_seen) >= 1, "with k = 3 some off-policy samples should have been used"
