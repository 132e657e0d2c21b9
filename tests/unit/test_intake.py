"""Rank 0's intake with algo.filter_equal_rewards: equal-reward groups are consumed and the batch topped up."""

import time

import numpy as np
import structlog
from conftest import rollout_group

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.core.ledger import State
from learner.hub.core.records import Accepted
from learner.hub.server import Hub
from learner.update import MAX_FILTERED_BATCHES, take_batch
from protocol.config import load_config


def _hub_with(rewards: list[list[float]], *overrides: str) -> Hub:
    """A hub (thread not started) whose buffer holds one received group per reward row."""
    cfg = load_config(None, ["rollout.samples_per_prompt=3", "train.prompts_per_step=2", *overrides])
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    for row in rewards:
        key = hub.ledger.next_pending()
        hub.ledger.grant(key, "a0", time.monotonic() + 60)
        assert hub.ledger.receive(key)
        group = rollout_group(n=3, prompt_id=key[1], epoch=key[0])
        group.rewards = np.asarray(row, dtype=np.float32)
        hub.buffer.append(Accepted(key, group, time.monotonic()))
    return hub


def test_filter_consumes_equal_groups_and_tops_up():
    hub = _hub_with([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]], "algo.filter_equal_rewards=true")
    kept, filtered = take_batch(hub, hub.cfg, {"flag": False}, structlog.get_logger())
    assert [list(i.group.rewards) for i in kept] == [[0, 1, 0], [1, 0, 1]]
    assert [list(i.group.rewards) for i in filtered] == [[1, 1, 1], [0, 0, 0]]
    assert not hub.buffer


def test_without_filter_everything_trains():
    hub = _hub_with([[1, 1, 1], [0, 1, 0]])
    kept, filtered = take_batch(hub, hub.cfg, {"flag": False}, structlog.get_logger())
    assert len(kept) == 2 and filtered == []


def test_filter_gives_up_after_the_cap_and_keeps_the_update_size():
    n = 2
    rows = [[1.0, 1.0, 1.0]] * (MAX_FILTERED_BATCHES * n) + [[0, 1, 0]]
    hub = _hub_with(rows, "algo.filter_equal_rewards=true")
    kept, filtered = take_batch(hub, hub.cfg, {"flag": False}, structlog.get_logger())
    assert len(kept) == n and len(kept) + len(filtered) == MAX_FILTERED_BATCHES * n
    assert len(hub.buffer) == 1  # the informative group is still there for the next update


class _StopWhileWaiting:
    """The hub, but its first wait for more groups times out and the SIGTERM handler sets the stop flag meanwhile."""

    def __init__(self, hub: Hub, stop: dict):
        self.hub, self.stop, self.waits = hub, stop, 0

    def take_batch(self, n, timeout_s=None):
        if len(self.hub.buffer) < n:
            self.waits += 1
            self.stop.update(flag=True)
            raise TimeoutError
        return self.hub.take_batch(n, timeout_s)

    def __getattr__(self, name):
        return getattr(self.hub, name)


def test_stopping_while_topping_up_returns_taken_groups_to_the_queue():
    hub = _hub_with([[1, 1, 1], [0, 1, 0]], "algo.filter_equal_rewards=true")
    keys = [item.key for item in hub.buffer]
    stop = {"flag": False}
    waiting = _StopWhileWaiting(hub, stop)  # SIGTERM while it waits for a third group
    assert take_batch(waiting, hub.cfg, stop, structlog.get_logger()) is None and waiting.waits == 1
    assert [hub.ledger.entries[k].state for k in keys] == [State.PENDING, State.PENDING]


def _train_all_but(hub: Hub, untrained: int) -> None:
    """Every prompt of the one epoch (data.epochs = 1) not yet granted is trained but `untrained`, which stay pending."""
    keys = []
    while (key := hub.ledger.next_pending()) is not None:
        keys.append(key)
    for key in keys[untrained:]:
        hub.ledger.grant(key, "a0", time.monotonic() + 60)
        hub.ledger.receive(key)
        hub.ledger.trained(key)
    hub.ledger.queue.extend(keys[:untrained])  # popped above, never granted: back in the queue, still pending


def test_out_of_data_ends_the_wait_as_exhausted():
    """data.epochs all opened and fewer untrained prompts than a batch: nothing more can come. The learner used to
    wait for rollouts forever (a 60-minute chaos soak hung there once the demo's 1,000 epochs were trained)."""
    hub = _hub_with([[0, 1, 0]], "data.epochs=1")  # one received group in the buffer
    _train_all_but(hub, 0)
    stop = {"flag": False}
    assert take_batch(hub, hub.cfg, stop, structlog.get_logger()) is None
    assert stop == {"flag": True, "exhausted": True}
    assert len(hub.buffer) == 1 and hub.ledger.left_to_train() == 1  # the lone group stays received, untrained


def test_enough_data_left_keeps_waiting():
    import threading

    hub = _hub_with([[0, 1, 0]], "data.epochs=1")
    _train_all_but(hub, 1)  # one pending besides the buffered one: a batch of 2 can still fill
    stop = {"flag": False}
    threading.Timer(2.5, lambda: stop.update(flag=True)).start()
    assert take_batch(hub, hub.cfg, stop, structlog.get_logger()) is None
    assert "exhausted" not in stop  # it waited until stopped
