"""The hub's logic with no I/O: actor registry, admission, dispatch, batch buffer, eval rounds, export and restore.

    (identity, message, now) --handle()--> state changes --> [Out(identity, message), ...] to send
    now                      --tick()----> heartbeat and lease expiry; silent actors' leases back to the queue
    now                      --pump()----> grants, as far as admission control allows
    training thread          --take() / finish_update() / abort_update() / updates.set_max_staleness() / start_eval()

HubState routes each message to its part and holds what the parts share (the ledger, the counters, the
quarantine, the eval round). The parts, a module each: the actor registry (learner/hub/core/registry.py), rollout
groups admitted or refused (learner/hub/core/groups.py), grants (learner/hub/core/dispatch.py), and the policy version,
the staleness bound and the batch buffer (learner/hub/core/updates.py).

No socket, no event loop, no clock and no lock of its own: the caller passes the time and holds
the lock (learner/hub/server.py runs it behind the ROUTER socket, on its own thread), so every rule
here is unit-tested by calling it (tests/unit/test_hub_state.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from learner import staleness as st
from learner.data.prompts import PromptSet
from learner.hub.core import dispatch
from learner.hub.core.checks import GroupLimits
from learner.hub.core.evaluation import EvalRound
from learner.hub.core.groups import Groups
from learner.hub.core.ledger import Key, Ledger
from learner.hub.core.quarantine import Quarantine
from learner.hub.core.records import Accepted, ActorState, Out, error_reply
from learner.hub.core.registry import Registry
from learner.hub.core.updates import Updates
from protocol import messages as m
from protocol.config import Config
from protocol.logs import get_logger


class HubState:
    def __init__(self, cfg: Config, prompts: PromptSet, now: float, vocab_size: int | None = None):
        """`vocab_size`: rows of the model's embedding, the bound on token ids (learner/main.py passes it; None
        checks none, for hubs that train nothing)."""
        self.cfg = cfg
        self.prompts = prompts
        self.quarantine = Quarantine(cfg.hub.quarantine_after, cfg.hub.quarantine_window_s, cfg.hub.quarantine_s)
        self.log = get_logger()
        self.ledger = Ledger(len(prompts), cfg.data.epochs, cfg.run.seed)
        self.updates = Updates(cfg.staleness.max_staleness, cfg.train.mini_batches * cfg.train.ppo_epochs)
        self.eval_round: EvalRound | None = None  # at most one; its grants never count as outstanding
        self.counters: Counter[str] = Counter()  # shared with the parts below: kept (restore refills it in place)
        self.started = now
        self.registry = Registry(cfg, self.quarantine, self.updates, self.counters, self._give_back)
        limits = GroupLimits.of(cfg, vocab_size)
        self.groups = Groups(cfg, prompts, limits, self.quarantine, self.updates, self.counters, self.registry.release)
        self.ready = dispatch.Ready()  # the actors that asked for work, in turn

    # ---- what the parts hold, as the handlers, the server, control.py and the tests read it --------------
    @property
    def actors(self) -> dict[str, ActorState]:
        return self.registry.actors

    @property
    def listeners(self) -> list[Callable[[str, bool], None]]:
        return self.registry.listeners

    @property
    def version(self) -> int:
        return self.updates.version

    @property
    def max_staleness(self) -> int:
        return self.updates.max_staleness

    @property
    def optimizer_steps(self) -> int:
        """S: optimizer steps (versions) per update."""
        return self.updates.optimizer_steps

    @property
    def training(self) -> bool:
        return self.updates.training

    @property
    def buffer(self) -> deque[Accepted]:
        return self.updates.buffer

    # ---- actor messages ---------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: m.Message, now: float, key: str | None = None) -> list[Out]:
        """One message from `identity` (its CURVE key's name `key`, None when CURVE is off): what to send back,
        and to whomever it lets the dispatcher grant to."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counters["protocol_errors"] += 1
            return [error_reply(identity, "protocol", f"{type(msg).__name__} is not for the hub")]
        if self.quarantine.refuses_identity(identity, now):
            self.counters["quarantined_messages"] += 1
            return [error_reply(identity, "quarantined", "this connection's actor is quarantined for sending refused groups")]
        return handler(self, identity, msg, now, key)

    def _register(self, identity: bytes, msg: m.Register, now: float, key: str | None) -> list[Out]:
        return self.registry.register(identity, msg, now, key)

    def _heartbeat(self, identity: bytes, msg: m.Heartbeat, now: float, key: str | None) -> list[Out]:
        if (state := self.registry.served(identity, msg.actor_id, msg.served_version, now)) is None:
            return self.registry.unknown(identity, msg.actor_id)
        self._wants(msg.actor_id, state)
        return []

    def _work_request(self, identity: bytes, msg: m.WorkRequest, now: float, key: str | None) -> list[Out]:
        state = self.registry.known(msg.actor_id, identity, now)
        if state is None:
            return self.registry.unknown(identity, msg.actor_id)
        state.demand = max(0, msg.max_prompts - len(state.held))  # a capacity (protocol 3), not more room
        self._wants(msg.actor_id, state)
        return self.pump(now)

    def _weight_version(self, identity: bytes, msg: m.WeightVersion, now: float, key: str | None) -> list[Out]:
        if (state := self.registry.served(identity, msg.actor_id, msg.served_version, now)) is None:
            return self.registry.unknown(identity, msg.actor_id)
        self._wants(msg.actor_id, state)  # dropped from the queue while it served an older version
        self.log.debug("hub.actor_synced", actor=msg.actor_id, served=msg.served_version, load_s=round(msg.load_s, 4))
        return self.pump(now)

    def _rollout(self, identity: bytes, msg: m.RolloutGroup, now: float, key: str | None) -> list[Out]:
        state = self.registry.known(msg.actor_id, identity, now)
        if state is None:
            return self.registry.unknown(identity, msg.actor_id)
        out = self.groups.receive(identity, state, msg, now, self.ledger)
        self._wants(msg.actor_id, state)  # a lease fewer: below its share again
        return [*out, *self.pump(now)]

    def _eval_result(self, identity: bytes, msg: m.EvalResult, now: float, key: str | None) -> list[Out]:
        state = self.registry.known(msg.actor_id, identity, now)
        if state is None:
            return self.registry.unknown(identity, msg.actor_id)
        rnd = self.eval_round
        out: list[Out] = []
        if rnd is not None and msg.eval_round == rnd.round_id:
            why = rnd.receive(msg)
            if why is not None:
                self.log.warning("hub.eval_result_rejected", actor=msg.actor_id, why=why)
                out.append(error_reply(identity, "rejected", why))
        else:
            self.counters["eval_late"] += 1  # its round already ended (timeout)
        return [*out, *self.pump(now)]

    _handlers: dict[type, Callable[[HubState, bytes, Any, float, str | None], list[Out]]] = {
        m.Register: _register,
        m.Heartbeat: _heartbeat,
        m.WorkRequest: _work_request,
        m.RolloutGroup: _rollout,
        m.EvalResult: _eval_result,
        m.WeightVersion: _weight_version,
    }

    # ---- dispatch (learner/hub/core/dispatch.py) ----------------------------------------------------------
    def _wants(self, actor_id: str, state: ActorState) -> None:
        if state.demand > 0:
            self.ready.want(actor_id)

    def sync_order(self, actor_ids: list[str]) -> list[str]:
        """The order to send a new version in: least recently granted first. After each update the first actors to
        report the new version take the room it opened, so a fixed order (sorted ids) would serve the same few."""
        return self.ready.order(actor_ids)

    def outstanding(self) -> int:
        """Prompts granted (every lease an actor holds is a granted prompt of the ledger's) plus groups buffered."""
        return len(self.ledger.granted) + len(self.buffer)

    def pump(self, now: float) -> list[Out]:
        """Grant prompts to actors with demand, as far as admission control allows; eval grants first (the learner
        is waiting on them). O(1) when there is nothing to grant, O(1) per grant otherwise (dispatch.py says why)."""
        sends: list[Out] = []
        if self.eval_round is not None and self.eval_round.pending:
            sends = dispatch.eval_grants(self.eval_round, self.actors, self.cfg.actor.max_groups, now)
            self.counters["eval_granted"] += len(sends)
        capacity = self.updates.capacity(self.cfg.train.prompts_per_step, self.outstanding())
        if capacity <= 0 or not self.ready:
            return sends
        min_version = st.min_grant_version(self.version)
        slots = self.updates.capacity(self.cfg.train.prompts_per_step, 0)
        share = max(1, -(-slots // max(1, len(self.actors) - self.registry.quiet)))  # slots / live actors, rounded up
        grants, granted = dispatch.work_grants(
            self.ready, self.actors, self.ledger, self.prompts, capacity, share, min_version, self.cfg.staleness.lease_s, now
        )
        self.counters["granted"] += len(granted)
        if granted:  # debug: lets an operator (and the multi-host test) follow which actor holds which prompt
            self.log.debug("hub.granted", grants=granted)
        return [*sends, *grants]

    # ---- membership (learner/hub/core/registry.py) --------------------------------------------------------
    def _give_back(self, actor_id: str, state: ActorState, requeue: str) -> list[Key]:
        """A removed actor's eval prompts and grants go back (`requeue`: the ledger's reason); the keys requeued."""
        if self.eval_round is not None:
            self.eval_round.release_actor(actor_id)
        # held may still name a prompt another actor delivered late since: trained by now, its epoch maybe closed
        requeued = [key for key in state.held if self.ledger.holder(key) == actor_id]
        for key in requeued:
            self.ledger.requeue(key, requeue)
        return requeued

    def tick(self, now: float) -> None:
        """Declare silent actors dead, expire leases and eval grants (the server calls it once a second)."""
        self.registry.expire(now)
        silent = self.registry.silent(now)
        for actor_id, state in silent:
            self._give_back(actor_id, state, "silent")
            state.held.clear()
        if any(s.held == set() and s.silent for _, s in silent):  # the others' share grew: back in line, all of them
            for actor_id, state in self.actors.items():
                if not state.silent:
                    self._wants(actor_id, state)
        expired = self.ledger.expire(now)
        self.quarantine.expire(now)
        if self.eval_round is not None:
            self.eval_round.expire(now)
        self.registry.lapsed(expired)
        if expired:
            self.log.warning("hub.leases_expired", count=len(expired))

    # ---- training thread ------------------------------------------------------------------------
    def take(self, n: int) -> list[Accepted] | None:
        """Drop (and requeue) buffered groups too stale for the next update; take the `n` oldest if there are that
        many (Updates.take)."""
        batch, dropped = self.updates.take(n)
        for item in dropped:
            self.groups.drop_stale(item, self.ledger)
        return batch

    def finish_update(self, version: int, trained: list[Key]) -> None:
        """The update that consumed `trained` produced `version`; grants may resume."""
        for key in trained:
            self.ledger.trained(key)
        self.updates.finish(version)

    def abort_update(self, batch: list[Accepted], version: int | None = None) -> None:
        """A failed update returns its prompts to the queue (never silently lost). `version`: the version the steps
        it did apply reached (an update with a skipped step still ran the others); None: the weights are unchanged."""
        for item in batch:
            self.ledger.requeue(item.key, "aborted")
        self.updates.abort(version)

    def snapshot(self) -> dict[str, float]:
        """Counters for the metrics line."""
        out = {f"hub/{k}": float(v) for k, v in self.counters.items()}
        out.update({f"ledger/{k}": float(v) for k, v in self.ledger.counts.items()})
        out.update({f"ledger/{k}": float(v) for k, v in self.ledger.state_counts().items()})
        out["hub/actors"] = float(len(self.actors))
        out["hub/buffered"] = float(len(self.buffer))
        out["staleness/max_staleness"] = float(self.max_staleness)
        return out

    # ---- learner restart (learner/resume.py) ------------------------------------------------------
    def export_state(self, now: float) -> dict[str, Any]:
        """What a checkpoint keeps of the hub: the ledger, the counters, the bound in force, the quarantined ids."""
        return {
            "ledger": self.ledger.state_dict(),
            "counters": dict(self.counters),
            "max_staleness": self.max_staleness,
            "quarantine": self.quarantine.export(now),
        }

    def restore(self, state: dict[str, Any], version: int, now: float) -> None:
        """Continue from a checkpoint taken at `version`."""
        ledger = Ledger.from_state(state["ledger"], self.cfg.data.epochs)
        if ledger.num_prompts != len(self.prompts):
            raise ValueError(
                f"data: the checkpoint's ledger has {ledger.num_prompts} prompts, the prompt set now has "
                f"{len(self.prompts)}; resume with the same data (data.path, data.val_fraction, run.seed)"
            )
        self.updates.restore(version, state["max_staleness"])  # the bound in force then (it may have been changed live)
        self.ledger = ledger
        self.counters.clear()
        self.counters.update(state["counters"])
        self.quarantine.restore(state.get("quarantine", {}), now)  # checkpoints from before it was kept have none
