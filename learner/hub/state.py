"""The hub's logic with no I/O: actor registry, admission, dispatch, batch buffer, eval rounds, export and restore.
A rollout group is admitted only for a prompt granted to its actor and after learner/hub/checks.py's checks;
an actor whose groups keep failing them is quarantined (learner/hub/quarantine.py).

    (identity, message, now) --handle()--> state changes --> [Out(identity, message), ...] to send
    now                      --tick()----> heartbeat and lease expiry
    now                      --pump()----> grants, as far as admission control allows
    training thread          --take() / finish_update() / abort_update() / set_max_staleness() / start_eval()

No socket, no event loop, no clock and no lock of its own: the caller passes the time and holds
the lock (learner/hub/server.py runs it behind the ROUTER socket, on its own thread), so every rule
here is unit-tested by calling it (tests/unit/test_hub_state.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from learner.data.prompts import PromptSet
from learner import staleness as st
from learner.hub.checks import GroupLimits, Refusal, check_group
from learner.hub.evaluation import EvalRound
from learner.hub.ledger import Key, Ledger, State
from learner.hub.quarantine import Quarantine
from learner.hub.records import MAX_DETAIL, RECENT_GROUPS, Accepted, ActorState, Out, UpdateTimes, error_reply
from protocol import messages as m
from protocol.config import Config
from protocol.logs import get_logger

# Refusals that are no actor's fault, so never a strike toward quarantine: a `reward` out of bounds is the run's
# own reward function, the same on every actor (quarantining would shut out the whole fleet; it is logged for the
# operator); a `finish` reason other than stop or length is vLLM's (an actor regenerates such groups before it
# sends one, actors/rollout.py, and one from before that change must not be shut out for it).
NO_FAULT = frozenset({"reward", "finish"})


class HubState:
    def __init__(self, cfg: Config, prompts: PromptSet, now: float, vocab_size: int | None = None):
        """`vocab_size`: rows of the model's embedding, the bound on token ids (learner/main.py passes it; None
        checks none, for hubs that train nothing)."""
        self.cfg = cfg
        self.prompts = prompts
        self.limits = GroupLimits.of(cfg, vocab_size)
        self.quarantine = Quarantine(cfg.hub.quarantine_after, cfg.hub.quarantine_window_s, cfg.hub.quarantine_s)
        self.log = get_logger()
        self.ledger = Ledger(len(prompts), cfg.data.epochs, cfg.run.seed)
        self.actors: dict[str, ActorState] = {}
        self.buffer: deque[Accepted] = deque()
        self.version = 0
        self.training = False
        self.max_staleness = cfg.staleness.max_staleness
        self.steps = cfg.train.mini_batches * cfg.train.ppo_epochs  # optimizer steps (versions) per update
        self.eval_round: EvalRound | None = None  # at most one; its grants never count as outstanding
        self.counters: Counter[str] = Counter()
        self.started = now
        self.batch_max_staleness = self.max_staleness  # the k the current update's batch was checked with
        self.recent_staleness: deque[int] = deque(maxlen=RECENT_GROUPS)  # (u + S - 1) - v of taken groups
        self.times = UpdateTimes()
        # Who is told when an actor registers or is removed (the weight sender): fn(actor_id, joined).
        self.listeners: list[Callable[[str, bool], None]] = []

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
        if self.quarantine.refuses_id(msg.actor_id, now):
            self.counters["quarantined_messages"] += 1
            self.log.warning("hub.register_refused", actor=msg.actor_id, key=key, why="quarantined")
            return [error_reply(identity, "quarantined", f"actor id {msg.actor_id!r} is quarantined for sending refused groups")]
        old = self.actors.get(msg.actor_id)
        if old is not None and old.key != key:  # only the key that registered an id may take it over
            self.counters["register_wrong_key"] += 1
            self.log.warning("hub.register_refused", actor=msg.actor_id, key=key, owner=old.key)
            return [
                error_reply(
                    identity, "id_taken", f"actor id {msg.actor_id!r} is registered with another key; pick another id (fleetrl actor --id)"
                )
            ]
        # A retry from the same connection (queued retries arrive together when a learner comes back). But -1
        # from an actor this hub saw serving a version is a rejoin: its sync failed and its worker left the
        # weight group, which must re-form, so it counts as new.
        repeat = old is not None and old.identity == identity and (msg.served_version >= 0 or old.served_version < 0)
        if old is not None and repeat:
            old.last_seen = now
        else:
            if old is not None:  # same id, new connection (the old one is gone), or a rejoin
                self.release(msg.actor_id, "replaced by a new connection" if old.identity != identity else "rejoined (served -1)")
            # One actor per connection: a peer cycling through ids cannot grow the registry (or the weight
            # group, whose every member must answer) without bound.
            for other in [a for a, s in self.actors.items() if s.identity == identity]:
                self.release(other, f"its connection registered again as {msg.actor_id!r}")
                self.counters["reregistered"] += 1
            self.actors[msg.actor_id] = ActorState(
                identity, now, self._trusted(msg.served_version), joined_at=now, key=key, devices=list(msg.devices)
            )
            for fn in self.listeners:
                fn(msg.actor_id, True)
            self.log.info(
                "hub.actor_registered", actor=msg.actor_id, host=msg.host, pid=msg.pid, served=msg.served_version, ranks=len(msg.devices)
            )
        return [Out(identity, m.RegisterAck(actor_id=msg.actor_id, policy_version=self.version, heartbeat_s=self.cfg.hub.heartbeat_s))]

    def _known(self, actor_id: str, identity: bytes, now: float) -> ActorState | None:
        state = self.actors.get(actor_id)
        if state is None or state.identity != identity:
            return None
        state.last_seen = now
        return state

    def _unknown(self, identity: bytes, actor_id: str) -> list[Out]:
        self.counters["unknown_actor"] += 1
        return [error_reply(identity, "unknown_actor", f"actor {actor_id!r} is not registered; register again")]

    def _served(self, identity: bytes, actor_id: str, served_version: int, now: float) -> ActorState | None:
        """Record the version an actor serves (max: a heartbeat sent before a sync may arrive after it)."""
        state = self._known(actor_id, identity, now)
        if state is not None:
            state.served_version = max(state.served_version, self._trusted(served_version))
        return state

    def _heartbeat(self, identity: bytes, msg: m.Heartbeat, now: float, key: str | None) -> list[Out]:
        if self._served(identity, msg.actor_id, msg.served_version, now) is None:
            return self._unknown(identity, msg.actor_id)
        return []

    def _work_request(self, identity: bytes, msg: m.WorkRequest, now: float, key: str | None) -> list[Out]:
        state = self._known(msg.actor_id, identity, now)
        if state is None:
            return self._unknown(identity, msg.actor_id)
        state.demand = max(0, msg.max_prompts - len(state.held))  # a capacity (protocol 3), not more room
        return self.pump(now)

    def _weight_version(self, identity: bytes, msg: m.WeightVersion, now: float, key: str | None) -> list[Out]:
        if self._served(identity, msg.actor_id, msg.served_version, now) is None:
            return self._unknown(identity, msg.actor_id)
        self.log.debug("hub.actor_synced", actor=msg.actor_id, served=msg.served_version, load_s=round(msg.load_s, 4))
        return self.pump(now)

    def _rollout(self, identity: bytes, msg: m.RolloutGroup, now: float, key: str | None) -> list[Out]:
        state = self._known(msg.actor_id, identity, now)
        if state is None:
            return self._unknown(identity, msg.actor_id)
        group_key = (msg.epoch, msg.prompt_id)
        n, expected = msg.lengths.shape[0], self.cfg.rollout.samples_per_prompt
        if msg.version_min > self.version:  # weights this learner never had (a lost learner's): no fault of the actor
            return self._refuse(
                identity,
                state,
                msg.actor_id,
                group_key,
                now,
                strike=False,
                refusal=Refusal("ahead", f"group of version {msg.version_min} is newer than the learner's {self.version}"),
            )
        if not self.ledger.may_deliver(group_key, msg.actor_id):
            # A prompt of no opened epoch was granted to nobody: the actor's fault. A real prompt may be an honest
            # actor's late result whose lapsed grant went to another and came back (stale, aborted): no strike.
            fault = group_key not in self.ledger.entries
            return self._refuse(
                identity, state, msg.actor_id, group_key, now, Refusal("grant", f"not granted to {msg.actor_id!r}"), strike=fault
            )
        if n != expected:
            return self._refuse(
                identity, state, msg.actor_id, group_key, now, Refusal("size", f"group has {n} samples, expected {expected}")
            )
        if self.ledger.entries[group_key].state in (State.GRANTED, State.PENDING):  # duplicates are dropped unread
            refusal = check_group(msg, self.prompts[msg.prompt_id].tokens, self.limits)
            if refusal is not None:
                return self._refuse(identity, state, msg.actor_id, group_key, now, refusal, strike=refusal.reason not in NO_FAULT)
        state.held.discard(group_key)
        if self.ledger.receive(group_key):
            state.groups += 1
            item = Accepted(group_key, msg, now)
            state.note_arrival(now)
            if st.admissible(self.version, msg.version_min, self.max_staleness, self.steps):
                self.buffer.append(item)
                if state.first_version is None:  # its first group that can be trained: its version must be one it was sent
                    state.first_version = msg.version_min
                    self.log.info(
                        "hub.actor_first_group",
                        actor=msg.actor_id,
                        version=msg.version_min,
                        learner_version=self.version,
                        after_s=round(now - state.joined_at, 3),
                    )
            else:  # already too stale on arrival: versions only grow, it can never be used
                self._drop_stale(item)
        self.log.debug("hub.group_received", actor=msg.actor_id, key=group_key, version=msg.version_min)
        return self.pump(now)

    def _eval_result(self, identity: bytes, msg: m.EvalResult, now: float, key: str | None) -> list[Out]:
        state = self._known(msg.actor_id, identity, now)
        if state is None:
            return self._unknown(identity, msg.actor_id)
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

    def _trusted(self, served_version: int) -> int:
        """A version above the learner's comes from weights of a learner that died after its last checkpoint
        (the resumed one retrains those versions differently): it counts as none (-1)."""
        if served_version > self.version:
            self.counters["served_ahead"] += 1
            return -1
        return served_version

    def _drop_stale(self, item: Accepted) -> None:
        """The sample may never be trained on; its prompt goes back to the queue."""
        self.counters["dropped_stale"] += 1
        self.log.debug(
            "hub.dropped_stale", key=item.key, sample_version=item.group.version_min, learner_version=self.version, k=self.max_staleness
        )
        self.ledger.requeue(item.key, "stale")

    def _refuse(
        self, identity: bytes, state: ActorState, actor_id: str, key: Key, now: float, refusal: Refusal, strike: bool = True
    ) -> list[Out]:
        """A group not admitted: counted by reason, its prompt back to the queue, the actor told which check failed.
        With `strike` (the actor's fault) it counts toward quarantining the actor."""
        self.counters[f"rejected_{refusal.reason}"] += 1
        # A reward out of bounds may be this prompt's every time: behind the queue, it cannot take every next grant.
        self._take_back(state, actor_id, key, front=refusal.reason != "reward")
        out = [error_reply(identity, "rejected", f"group for prompt {key[1]} (epoch {key[0]}) refused, {refusal.reason}: {refusal.detail}")]
        if strike or refusal.reason in NO_FAULT:
            self.log.warning("hub.group_rejected", actor=actor_id, key=key, reason=refusal.reason, detail=refusal.detail[:MAX_DETAIL])
        if strike:
            strikes = self.quarantine.strike(actor_id, now)
            if strikes is not None:
                self.quarantine.add(actor_id, identity, now)
                self.release(actor_id, "quarantined", requeue="quarantined")
                self.counters["actors_quarantined"] += 1
                q = self.cfg.hub
                self.log.warning(
                    "hub.actor_quarantined",
                    actor=actor_id,
                    key=state.key,
                    refused=strikes,
                    window_s=q.quarantine_window_s,
                    for_s=q.quarantine_s,
                    last_reason=refusal.reason,
                )
                out.append(
                    error_reply(
                        identity,
                        "quarantined",
                        f"{strikes} groups refused within {q.quarantine_window_s:g} s (the last: "
                        f"{refusal.reason}); actor {actor_id!r} is refused for {q.quarantine_s:g} s",
                    )
                )
        return [*out, *self.pump(now)]

    def _take_back(self, state: ActorState, actor_id: str, key: Key, front: bool = True) -> None:
        """A rejected group's prompt goes back to the queue now, not at its lease's end, and frees the actor's slot
        (its requests are capacities)."""
        if key in state.held and self.ledger.entries[key].actor == actor_id:
            state.held.discard(key)
            self.ledger.requeue(key, "rejected", front)

    # ---- dispatch -------------------------------------------------------------------------------
    def outstanding(self) -> int:
        return sum(len(a.held) for a in self.actors.values()) + len(self.buffer)

    def pump(self, now: float) -> list[Out]:
        """Grant prompts to actors with demand, as far as admission control allows; eval grants first (the learner
        is waiting on them)."""
        sends = [Out(identity, grant, reply=False) for identity, grant in self._eval_grants(now)]
        granted: list[tuple[str, int, int]] = []  # (actor, epoch, prompt id)
        capacity = st.admission_capacity(
            self.version, self.training, self.max_staleness, self.cfg.train.prompts_per_step, self.outstanding(), self.steps
        )
        min_version = st.min_grant_version(self.version)
        lease_s = self.cfg.staleness.lease_s
        # Fairness: least-loaded actors first.
        for actor_id, state in sorted(self.actors.items(), key=lambda kv: len(kv[1].held)):
            if state.served_version < min_version:
                continue  # it would generate samples already too stale (or it awaits its first sync)
            while state.demand > 0 and capacity > 0:
                key = self.ledger.next_pending()
                if key is None:
                    break
                self.ledger.grant(key, actor_id, now + lease_s)
                state.held.add(key)
                granted.append((actor_id, *key))
                state.demand -= 1
                capacity -= 1
                prompt = self.prompts[key[1]]
                sends.append(
                    Out(
                        state.identity,
                        m.WorkGrant(
                            prompt_id=key[1],
                            epoch=key[0],
                            prompt_tokens=prompt.tokens,
                            answer=prompt.answer,
                            policy_version=min_version,
                            lease_s=lease_s,
                            prompt=prompt.text,
                            metadata=prompt.metadata,
                        ),
                        reply=False,
                    )
                )
        self.counters["granted"] += len(granted)
        if granted:  # debug: lets an operator (and the multi-host test) follow which actor holds which prompt
            self.log.debug("hub.granted", grants=granted)
        return sends

    def _eval_grants(self, now: float) -> list[tuple[bytes, m.EvalGrant]]:
        """Prompts of the open eval round for the actors serving exactly its version."""
        rnd = self.eval_round
        if rnd is None:
            return []
        ready = [a for a, s in self.actors.items() if s.served_version == rnd.version]
        out = [(self.actors[a].identity, grant) for a, grant in rnd.assign(ready, self.cfg.actor.max_groups, now)]
        self.counters["eval_granted"] += len(out)
        return out

    # ---- membership -----------------------------------------------------------------------------
    def release(self, actor_id: str, why: str, requeue: str = "dead") -> None:
        """Forget an actor and requeue what it held (`requeue`: the ledger's reason; "dead" lets it deliver late)."""
        state = self.actors.pop(actor_id)
        if self.eval_round is not None:
            self.eval_round.release_actor(actor_id)
        requeued = [key for key in state.held if self.ledger.entries[key].actor == actor_id]
        for key in requeued:
            self.ledger.requeue(key, requeue)
        for fn in self.listeners:
            fn(actor_id, False)
        self.log.warning("hub.actor_removed", actor=actor_id, why=why, requeued=len(requeued), keys=sorted(requeued))

    def connection_closed(self, identity: bytes) -> None:
        """The connection `identity` closed (a killed process: its kernel closes the socket): its actor is gone now,
        not after hub.actor_timeout_s."""
        for actor_id in [a for a, state in self.actors.items() if state.identity == identity]:
            self.release(actor_id, "connection closed")
            self.counters["actors_lost"] += 1
            self.counters["actors_disconnected"] += 1

    def evict(self, actor_id: str, why: str) -> bool:
        """Remove a live actor (its grants go back to the queue); False if it is not registered."""
        if actor_id not in self.actors:
            return False
        self.release(actor_id, why)
        self.counters["actors_evicted"] += 1
        return True

    def tick(self, now: float) -> None:
        """Declare silent actors dead, expire leases and eval grants (the server calls it once a second)."""
        for actor_id in [a for a, s in self.actors.items() if now - s.last_seen > self.cfg.hub.actor_timeout_s]:
            self.release(actor_id, "heartbeat timeout")
            self.counters["actors_lost"] += 1
        expired = self.ledger.expire(now)
        self.quarantine.expire(now)
        if self.eval_round is not None:
            self.eval_round.expire(now)
        for key in expired:
            for state in self.actors.values():
                state.held.discard(key)
        if expired:
            self.log.warning("hub.leases_expired", count=len(expired))

    def devices(self, actor_ids: list[str]) -> list[list[str]]:
        """Each actor's device identities as it registered them, one per weight-group rank it holds. An actor
        removed meanwhile counts as one CPU rank: the sender gives up any attempt it is part of anyway."""
        return [list(s.devices) if (s := self.actors.get(a)) is not None else [""] for a in actor_ids]

    # ---- training thread ------------------------------------------------------------------------
    def take(self, n: int) -> list[Accepted] | None:
        """Drop (and requeue) buffered groups too stale for the next update; take the `n` oldest if there are that many.

        Groups stay in the buffer, counted as outstanding by admission control, until the whole batch is there:
        taking them one by one would let the dispatcher over-grant while the batch fills.
        """
        ok = [i for i in self.buffer if st.admissible(self.version, i.group.version_min, self.max_staleness, self.steps)]
        if len(ok) < len(self.buffer):
            for item in self.buffer:
                if not st.admissible(self.version, item.group.version_min, self.max_staleness, self.steps):
                    self._drop_stale(item)
            self.buffer = deque(ok)
        if len(self.buffer) < n:
            return None
        # Oldest versions first (stable in arrival order): they are the ones that would expire at the next update.
        # Arrival order alone drops late, older groups.
        batch = sorted(self.buffer, key=lambda i: i.group.version_min)[:n]
        taken = {id(i) for i in batch}
        self.buffer = deque(i for i in self.buffer if id(i) not in taken)
        # A top-up take (learner/hub/intake.py) joins an update already being assembled: its groups passed an earlier
        # take's k, so the update's bound is the largest k of its takes.
        k = self.max_staleness
        self.batch_max_staleness = max(self.batch_max_staleness, k) if self.training else k
        self.recent_staleness.extend(self.version + self.steps - 1 - i.group.version_min for i in batch)
        self.training = True
        return batch

    def finish_update(self, version: int, trained: list[Key]) -> None:
        """The update that consumed `trained` produced `version`; grants may resume."""
        for key in trained:
            self.ledger.trained(key)
        self.version = version
        self.training = False

    def abort_update(self, batch: list[Accepted], version: int | None = None) -> None:
        """A failed update returns its prompts to the queue (never silently lost). `version`: the version the steps
        it did apply reached (an update with a skipped step still ran the others); None: the weights are unchanged."""
        for item in batch:
            self.ledger.requeue(item.key, "aborted")
        if version is not None:
            assert version >= self.version, f"version {version} < {self.version}"
            self.version = version
        self.training = False

    def set_max_staleness(self, k: int, source: str) -> int:
        """Takes effect for admission at once and for every batch taken after it (learner/hub/control.py); returns
        the old k. Raises ValueError for a k even fresh samples would break."""
        if k < self.steps - 1:
            raise ValueError(f"max_staleness: {k} < {self.steps} optimizer steps per update - 1; even fresh samples would break it")
        old, self.max_staleness = self.max_staleness, k
        self.log.info("hub.max_staleness_changed", old=old, new=k, version=self.version, source=source)
        return old

    def note_update(self, step_s: float, sync_started: float | None, sync_s: float, broadcast_s: float | None) -> None:
        """The training thread's timings of the update it just finished. `sync_started` is time.monotonic() at the
        start of the weight sync, None when there was none (every step skipped: nothing moved, nothing was sent);
        `broadcast_s` the duration of the last finished broadcast, None when there was none."""
        t = self.times
        t.updates, t.step_s = t.updates + 1, step_s
        if sync_started is None:
            return
        t.syncs, t.sync_started, t.sync_s = t.syncs + 1, sync_started, sync_s
        if broadcast_s is not None:
            t.broadcast_s = broadcast_s

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
        k = state["max_staleness"]  # the bound in force when the checkpoint was taken (it may have been changed live)
        if k < self.steps - 1:
            raise ValueError(f"max_staleness: the checkpoint's {k} < {self.steps} optimizer steps per update - 1")
        if k != self.max_staleness:
            self.log.info("hub.max_staleness_restored", config=self.max_staleness, checkpoint=k)
        self.ledger, self.version, self.max_staleness, self.batch_max_staleness = ledger, version, k, k
        self.counters = Counter(state["counters"])
        self.quarantine.restore(state.get("quarantine", {}), now)  # checkpoints from before it was kept have none
