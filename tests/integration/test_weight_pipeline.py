"""Buckets in flight two at a time over a real gloo weight group (the learner's WeightSender, an actor's WeightReceiver
on a thread, the code the vLLM worker runs): the next bucket arrives while the receiver loads the one before, and
never into memory the receiver is reading.

The parameters: a 4 MiB one (its own bucket, sizing the receiver's landing buffer), then eight of 1 MiB with 1 MiB
buckets. Every parameter holds one value of its own, so a bucket that landed can be found in the landing buffer
while the load of another runs.
"""

import threading
import time

import torch

from actors.weight_receiver import WeightReceiver
from learner.weights.sync import WeightSender
from protocol.config import WeightsConfig
from tests.fake_hub import RecordingHub

MIB = 1 << 18  # fp32 elements in 1 MiB
SHAPES = [[4 * MIB]] + [[MIB]] * 8


def test_the_next_bucket_lands_beside_the_one_being_loaded():
    params = [torch.full(s, float(k + 1)) for k, s in enumerate(SHAPES)]
    sender = WeightSender.for_params(WeightsConfig(bucket_mb=1, timeout_s=60), [(f"p{k}", p) for k, p in enumerate(params)], "float32")
    assert len(sender.ranges) == len(SHAPES)  # one bucket per parameter
    hub = RecordingHub({"receiver": [""]})
    sender.sync(1, hub)
    (msg,) = hub.sent
    receiver = WeightReceiver()
    got: dict[str, float] = {}
    arrived_during: list[bool] = []  # per bucket but the last: did the next one land while this one was loaded?
    intact: list[bool] = []  # per bucket: still its own bytes at the end of its load

    def holds(value: float) -> bool:
        """Some 1 MiB of the landing buffer holds bucket (value - 1) whole."""
        assert receiver.buffer is not None
        return bool((receiver.buffer.view(-1, MIB) == value).all(dim=1).any())

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        ((name, t),) = pairs
        k = int(name[1:])
        value = float(k + 1)
        assert bool((t == value).all()), f"{name} arrived torn"
        got[name] = value
        if k + 1 < len(SHAPES):
            # The 4 MiB bucket fills the buffer, so the first 1 MiB one may only come after its load: a while without
            # it proves that. Every 1 MiB one has room beside the one before: it must come during the load.
            failing = k == 0 or not all(arrived_during[1:])  # once one has not come, the test fails anyway: fail quickly
            deadline = time.monotonic() + (0.5 if failing else 20)
            while not holds(value + 1) and time.monotonic() < deadline:
                time.sleep(0.005)
            arrived_during.append(holds(value + 1))
            time.sleep(0.05)  # a receive started into this bucket's memory would land by now
        intact.append(bool((t == value).all()))

    outcome: list = []

    def receive() -> None:
        try:
            outcome.append(receiver.receive(msg, msg.rank, load))
        except AssertionError as e:  # a check in `load`
            outcome.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the receive did not end"
    report = sender.wait()
    (result,) = outcome
    assert not isinstance(result, AssertionError), result
    assert not result.failed and "weights/failed" not in report, (result, report)
    assert got == {f"p{k}": float(k + 1) for k in range(len(SHAPES))}
    assert intact == [True] * len(SHAPES), intact
    assert arrived_during == [False] + [True] * (len(SHAPES) - 2), arrived_during
