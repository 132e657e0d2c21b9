"""Where buckets sit in one reused buffer (protocol/weights.ring_offsets), and when rank 0's staging buffer must wait
for the bucket before (learner/weights/buckets.Staging): a bucket is never written where one still in flight is read."""

import torch

from learner.weights.buckets import Staging
from protocol import weights as wg


def test_buckets_follow_each_other_and_wrap_when_they_do_not_fit():
    # An embedding-sized bucket, then ordinary ones: four fit side by side where the large one was.
    assert wg.ring_offsets([4, 1, 1, 1, 1, 1, 3, 2], 4) == [0, 0, 1, 2, 3, 0, 1, 0]
    assert wg.ring_offsets([2, 2, 2], 2) == [0, 0, 0]  # the buffer holds one at a time: each lands on the one before
    assert wg.ring_offsets([], 0) == []


def test_overlap_is_of_half_open_ranges():
    assert wg.overlap((0, 2), (1, 3)) and wg.overlap((1, 3), (0, 2)) and wg.overlap((0, 4), (1, 2))
    assert not wg.overlap((0, 1), (1, 2)) and not wg.overlap((3, 4), (0, 1))


def test_staging_waits_only_for_a_bucket_it_would_overwrite():
    """The meta device stands for the other side of the PCIe bus (a CPU machine has no other): every bucket is
    copied across, into the ring, and `drain` (the pipeline's wait for what is in flight) is called exactly when
    the copy would land on the elements of the bucket before."""
    staging, drained = Staging(capacity=4), []
    placed = []
    for k, n in enumerate([4, 1, 1, 1, 1, 1, 3, 2]):
        out = staging.to(torch.device("meta"), torch.full((n,), float(k)), lambda k=k: drained.append(k))
        assert out.device.type == "meta" and out.numel() == n
        placed.append(out.storage_offset())
    assert placed == wg.ring_offsets([4, 1, 1, 1, 1, 1, 3, 2], 4)
    # k=1 lands on the 4-element bucket; k=7 at 0 on k=6's [1, 4). k=5 at 0 is clear of k=4's [3, 4).
    assert drained == [1, 7]
    same = torch.ones(3)
    assert staging.to(torch.device("cpu"), same, lambda: drained.append(-1)) is same and drained == [1, 7]
