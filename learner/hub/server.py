"""The hub on learner rank 0: the state machine (learner/hub/core/state.py) behind a ROUTER socket, on its own thread
(learner/hub/thread.py); `Hub` is the learner's handle on both.

    actors --Register/Heartbeat/WorkRequest/RolloutGroup/EvalResult/WeightVersion--> [ROUTER + CURVE gate]
                                                                                      |
          hub thread (a zmq_poll loop; owns the socket): decode --> HubState.handle --> send what it returns
          once a second: HubState.tick, RUN_DIR/control.toml, the allow-list   |  disconnect monitor
                                                                                      |
    training thread <-- take_batch() (blocks on `cond`) ------------------------------+
                    --> finish_update() / abort_update() / send_weight_sync()
                    --> start_eval() / wait_eval() (blocks on `cond`)

Only the hub thread touches the socket. Both threads share the HubState under `cond` (a Condition on
one lock); the training thread never waits on the network while holding it, and neither does the hub
thread: it sends what the state returned after letting the lock go.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner.data.prompts import PromptSet
from learner.hub.core.evaluation import EvalRound
from learner.hub.core.ledger import Key, Ledger
from learner.hub.core.records import Accepted, ActorState, Out
from learner.hub.core.state import HubState
from learner.hub.thread import HubThread
from protocol import messages as m
from protocol.config import Config
from protocol.logs import get_logger


class Hub:
    """The learner's handle on the hub: the training-thread API, and the thread that serves the socket."""

    def __init__(self, cfg: Config, prompts: PromptSet, control_file: Path | None = None, vocab_size: int | None = None):
        """`vocab_size`: rows of the model's embedding; token ids of admitted groups stay below it (None: unchecked)."""
        self.cfg = cfg
        self.log = get_logger()
        self.cond = threading.Condition()
        self.state = HubState(cfg, prompts, time.monotonic(), vocab_size)
        self._thread = HubThread(cfg, self.state, self.cond, control_file)  # reads the CURVE keys: a bad one fails here

    # ---- the state, read by the learner, its tests and `fleetrl status` ---------------------------------
    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def max_staleness(self) -> int:
        return self.state.max_staleness

    @property
    def batch_max_staleness(self) -> int:
        return self.state.updates.batch_max_staleness

    @property
    def optimizer_steps(self) -> int:
        """S: optimizer steps (versions) per update."""
        return self.state.optimizer_steps

    @property
    def actors(self) -> dict[str, ActorState]:
        return self.state.actors

    @property
    def buffer(self) -> deque[Accepted]:
        return self.state.buffer

    @property
    def eval_round(self) -> EvalRound | None:
        return self.state.eval_round

    @property
    def counters(self) -> Any:
        return self.state.counters

    # ---- training-thread API -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str = "run finished", tell_actors: bool = True) -> None:
        """Tell every actor to shut down (unless `tell_actors` is False: they wait for a resumed learner), then stop
        the hub thread."""
        if not self._thread.alive:
            return
        try:
            if tell_actors:
                with self.cond:
                    outs = [Out(s.identity, m.Shutdown(reason=reason), reply=False) for s in self.state.actors.values()]
                self._thread.send(outs, timeout_s=10)
        except TimeoutError:
            self.log.warning("hub.shutdown_timeout")
        self._thread.stop()

    def take_batch(self, n: int, timeout_s: float | None = None) -> list[Accepted]:
        """Block until `n` admissible groups are buffered, take the oldest; drop (and requeue) any too stale."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while (batch := self.state.take(n)) is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"only {len(self.state.buffer)} of {n} groups arrived in {timeout_s} s")
                self.cond.wait(timeout=remaining)
        return batch

    def left_to_train(self) -> int | None:
        """Prompts the data has left to train (None: more epochs to open); see Ledger.left_to_train."""
        with self.cond:
            return self.state.ledger.left_to_train()

    def finish_update(self, version: int, trained: list[Key]) -> None:
        """The update that consumed `trained` produced `version`; grants may resume."""
        with self.cond:
            self.state.finish_update(version, trained)
        self._thread.kick()

    def abort_update(self, batch: list[Accepted], version: int | None = None) -> None:
        """A failed update returns its prompts to the queue (never silently lost); `version`: where the steps it
        applied took the weights (None: unchanged)."""
        with self.cond:
            self.state.abort_update(batch, version)
        self._thread.kick()

    def start_eval(self, rnd: EvalRound) -> None:
        """Hand an eval round to the dispatcher: actors serving rnd.version get its prompts."""
        with self.cond:
            assert self.state.eval_round is None, "one eval round at a time"
            self.state.eval_round = rnd
        self._thread.kick()

    def wait_eval(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> EvalRound:
        """Block until the round is answered, `timeout_s` passes or `should_stop()`; then close it.

        Results that arrive after this are counted (hub/eval_late) and ignored.
        """
        deadline = time.monotonic() + timeout_s
        with self.cond:
            rnd = self.state.eval_round
            assert rnd is not None, "wait_eval without start_eval"
            while not rnd.done and not should_stop() and (remaining := deadline - time.monotonic()) > 0:
                self.cond.wait(timeout=min(1.0, remaining))
            self.state.eval_round = None
        return rnd

    def set_max_staleness(self, k: int, source: str = "api") -> int:
        """Takes effect for admission at once and for every batch taken after it; returns the old k."""
        with self.cond:
            old = self.state.updates.set_max_staleness(k, source)
        self._thread.kick()
        return old

    def note_update(self, step_s: float, sync_started: float | None, sync_s: float, broadcast_s: float | None) -> None:
        """The training thread's timings of the update it just finished, for `fleetrl status`."""
        with self.cond:
            self.state.updates.note_update(step_s, sync_started, sync_s, broadcast_s)

    def live_actors(self) -> list[str]:
        """The registered actors heard from within hub.silent_s (a hung one is left out of the weight group)."""
        with self.cond:
            return self.state.registry.live()

    def add_membership_listener(self, fn: Callable[[str, bool], None]) -> None:
        """`fn(actor_id, joined)` each time an actor registers (joined, also again under the same id) or is removed
        (dead, disconnected, evicted), and when it goes silent past hub.silent_s (not joined) and is heard again
        (joined), under the hub's lock: the rule it keeps is learner/weights/fleet.py's."""
        with self.cond:
            self.state.listeners.append(fn)

    def evict(self, actor_id: str, why: str) -> None:
        """Remove a live actor (its grants go back to the queue). The weight sender evicts a member that never
        joined its group epoch; the actor hears `unknown_actor` on its next message and registers again."""
        with self.cond:
            evicted = self.state.registry.evict(actor_id, why)
        if evicted:
            self._thread.kick()

    def devices(self, actor_ids: list[str]) -> list[list[str]]:
        with self.cond:
            return self.state.registry.devices(actor_ids)

    def send_weight_sync(self, members: list[str], make: Callable[[str], m.WeightSync]) -> None:
        """Send `make(actor_id)` (a WeightSync, its ranks chosen by the sender) to each member."""
        with self.cond:
            order = self.state.sync_order(members)  # least recently granted first: they report first, and are granted first
            outs = [Out(s.identity, make(a), reply=False) for a in order if (s := self.state.actors.get(a)) is not None]
        self._thread.send(outs, timeout_s=30)

    def snapshot(self) -> dict[str, float]:
        """Counters for the metrics line."""
        with self.cond:
            out = self.state.snapshot()
            out.update({f"hub/{k}": float(v) for k, v in self._thread.auth_counts().items()})
        return out

    def export_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the hub (learner/resume.py)."""
        with self.cond:
            return self.state.export_state(time.monotonic())

    def restore(self, state: dict[str, Any], version: int) -> None:
        """Before start(): continue from a checkpoint taken at `version`."""
        assert not self._thread.alive, "restore before the hub starts"
        with self.cond:
            self.state.restore(state, version, time.monotonic())
