"""One attempt at giving a version to a set of members, and the I/O it takes; the decisions are SenderState's.

    begin: the members' devices -> SenderState.begin (reuse the epoch or form a new one) -> WeightSync to each
    run:   new epoch: every member's joined key (weights.join_timeout_s; late ones evicted) -> connect the group
           -> buckets, IN_FLIGHT broadcasts at a time (protocol/abortable.py), each wait ended by a removed
              member within POLL_S
           ok: SenderState.served.   failed: `abort` in the store, the epoch's group closed (SenderState.gave_up)

It runs on the serving thread (learner/weights/serving.py), and `begin` of a sync's own attempt on the
training thread while the serving thread is stopped: one attempt at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from learner.weights.buckets import Buckets, Staging
from learner.weights.fleet import Fleet
from learner.weights.records import Attempt
from learner.weights.state import SenderState
from protocol import messages as m
from protocol import weights as wg
from protocol.abortable import Abortable, Aborted, Graveyard, abort_key, joined_key
from protocol.config import WeightsConfig
from protocol.logs import get_logger
from protocol.progress import phase

POLL_S = 0.02  # how often a long wait re-checks for a removed member: the latency of an abort
JOIN_POLL_S = 0.005  # how often rank 0 looks for the members' joined keys
# gloo connects every pair of ranks through rank 0's store: forming a group takes time that grows with the square of
# its size, and past about this many ranks it outlasts weights.join_timeout_s' default (docs/architecture.md).
GLOO_MESH_WARN_RANKS = 100


class Attempts:
    def __init__(
        self,
        cfg: WeightsConfig,
        *,
        names: list[str],
        shapes: list[list[int]],
        dtype: str,
        device: torch.device,
        buckets: Buckets | None,
        port: int,
        control: dist.TCPStore,
        state: SenderState[dist.ProcessGroup],
        lock: threading.Lock,
        stop: threading.Event,
    ):
        """`names`, `shapes` (full), `dtype`: what every WeightSync says of the weights. `port`: the rendezvous
        store's; `control`: our own client of it, for the joined/abort keys. `state` is shared under `lock`;
        `stop` is set when serving the version ends."""
        self.cfg = cfg
        self.names, self.shapes, self.dtype = names, shapes, dtype
        self.device = device
        self.buckets = buckets
        self.port = port
        self.control = control
        self.build_store = wg.BuildStore()
        self.state = state
        self.lock = lock
        self.stop = stop
        self.graveyard = Graveyard()
        # Buckets copied across the PCIe bus (GPU -> host for gloo, host -> GPU for NCCL), in one buffer of the largest.
        self.staging = Staging(wg.landing_numel(shapes, wg.DTYPES[dtype], cfg.bucket_mb << 20))
        self.log = get_logger()

    def begin(self, fleet: Fleet, version: int, members: list[str], catchup: bool = False) -> Attempt:
        """Pick the group epoch for `members` and send each its WeightSync."""
        devices = fleet.devices(members)
        with self.lock:
            begun = self.state.begin(version, members, devices, catchup)
        att, plan = begun.attempt, begun.attempt.plan
        if begun.close is not None:
            wg.close_group(*begun.close)
        if att.new_group:
            self.log.info(
                "weights.new_group_epoch",
                epoch=att.epoch,
                members=att.members,
                version=version,
                backend=plan.backend,
                world_size=plan.world_size,
                probation=att.side,
            )
            if plan.backend == "gloo" and not plan.lazy and plan.world_size > GLOO_MESH_WARN_RANKS:
                self.log.warning(
                    "weights.large_gloo_group",
                    epoch=att.epoch,
                    world_size=plan.world_size,
                    join_timeout_s=self.cfg.join_timeout_s,
                    why=f"gloo connects every pair of ranks; past {GLOO_MESH_WARN_RANKS} ranks forming the group can outlast the join "
                    "deadline, and members that miss it are evicted",
                    how="lower weights.gloo_mesh_ranks (larger groups then connect only the pairs the broadcast uses), or "
                    "raise weights.join_timeout_s above the formation time (docs/benchmarks.md)",
                )
            if plan.fallback:
                self.log.warning(
                    "weights.gloo_fallback",
                    epoch=att.epoch,
                    why=plan.fallback,
                    how="each bucket goes GPU -> pinned host memory -> gloo -> the members' GPUs",
                )
        rank_of = {a: (plan.first[k], plan.counts[k]) for k, a in enumerate(members)}

        def make(actor_id: str) -> m.WeightSync:
            first, count = rank_of[actor_id]
            return m.WeightSync(
                policy_version=version,
                group_epoch=att.epoch,
                store_host=self.cfg.host,
                store_port=self.port,
                rank=first,
                ranks=count,
                world_size=plan.world_size,
                backend=plan.backend,
                timeout_s=self.cfg.timeout_s,
                names=self.names,
                shapes=self.shapes,
                dtype=self.dtype,
                bucket_bytes=self.cfg.bucket_mb << 20,
                lazy=plan.lazy,
            )

        fleet.send_weight_sync(members, make)
        now = time.monotonic()
        live = fleet.live_actors()
        with self.lock:
            self.state.sent(att, live, now)
        return att

    def run(self, fleet: Fleet, att: Attempt, flats: list[torch.Tensor] | None) -> float | None:
        """One attempt: the seconds it took when every member holds att.version; None when it failed, which gives
        the epoch up."""
        waits = Abortable(should_abort=lambda: self._why_abort(att), timeout_s=self.cfg.timeout_s, graveyard=self.graveyard, poll_s=POLL_S)
        side: dist.ProcessGroup | None = None  # a probation epoch's own group: for this attempt only
        t0 = time.perf_counter()
        try:
            # Milliseconds normally; a member that dies ends it within POLL_S of the hub noticing.
            with phase(self.log, "weights.broadcast", quiet=True, epoch=att.epoch, members=len(att.members), version=att.version):
                if (why := self._why_abort(att)) is not None:
                    raise Aborted(why)
                group = self.state.group  # only this thread changes it
                if att.new_group:
                    self._await_joins(fleet, att)
                    group = self._connect(fleet, att)
                    side = group if att.side else None
                assert group is not None
                on = wg.group_device(att.plan.backend, self.device)
                with waits.pipeline() as pipe:  # every bucket has left when it exits; a failure abandons those in flight

                    def send(g: dist.ProcessGroup, flat: torch.Tensor) -> None:
                        pipe.room()  # at most the bucket before is still in flight
                        pipe.start(g, self.staging.to(on, flat, pipe.drain))  # `flat` unless it is on the other side

                    if self.buckets is None:
                        assert flats is not None
                        for flat in flats:
                            send(group, flat)
                    else:
                        self.buckets.send(group, flats, bcast=send)  # guarded (flats None): the step waits for this thread
            if side is not None:  # the members join the everyone epoch at the next sync
                wg.close_group(side, att.plan.backend)
                side = None
        except RuntimeError as e:  # Aborted; gloo's DistBackendError (a peer closed, a timeout)
            self._give_up(att, side, e, time.perf_counter() - t0)
            return None
        finally:
            with self.lock:
                self.state.ended()
        elapsed = time.perf_counter() - t0
        with self.lock:
            self.state.served(att)
        return elapsed

    def _why_abort(self, att: Attempt) -> str | None:
        with self.lock:
            return self.state.why_abort(att, self.stop.is_set())

    def _await_joins(self, fleet: Fleet, att: Attempt) -> None:
        """Until every member has set its joined key; one that has not by its deadline is evicted from the fleet,
        which gives the attempt up: the serving loop re-forms the epoch at once without it."""
        plan = att.plan
        keys = {
            a: [joined_key(att.epoch, r) for r in range(plan.first[k], plan.first[k] + plan.counts[k])] for k, a in enumerate(att.members)
        }  # one per rank: each engine worker joins on its own
        every = [key for ks in keys.values() for key in ks]

        def joined() -> set[str]:
            return {a for a, ks in keys.items() if self.control.check(ks)}  # store round trips

        with self.lock:
            self.state.joining(att)
        while not self.control.check(every):
            now = time.monotonic()
            with self.lock:
                overdue = self.state.overdue(att, now)
            late = [a for a in overdue if not self.control.check(keys[a])]
            if late:
                seen = joined()
                with self.lock:
                    verdict = self.state.late(att, late, seen)
                for a, reason in verdict.evict.items():
                    fleet.evict(a, reason)
                raise Aborted(verdict.why)
            if (why := self._why_abort(att)) is not None:
                seen = joined()
                with self.lock:
                    self.state.cut_short(att, seen, self.stop.is_set())
                raise Aborted(why)
            time.sleep(JOIN_POLL_S)
        seen = joined()
        with self.lock:
            self.state.settle(att, seen, carry=False)

    def _connect(self, fleet: Fleet, att: Attempt) -> dist.ProcessGroup:
        """Build the epoch's group (every member said it joined) by att.joins_by. A group that does not connect
        in time names no culprit: SenderState.connect_failed decides who is tried apart, or evicted."""
        waits = Abortable(
            should_abort=lambda: self._why_abort(att),
            timeout_s=max(0.0, att.joins_by - time.monotonic()),
            graveyard=self.graveyard,
            poll_s=POLL_S,
        )
        try:
            group = waits.build(lambda made: self._build(att, made), lambda g: wg.close_group(g, att.plan.backend))
        except Aborted:
            if self._why_abort(att) is None:  # the deadline, not a removal or a stop
                with self.lock:
                    evict = self.state.connect_failed(att)
                self.log.warning(
                    "weights.connect_failed", epoch=att.epoch, members=att.members, evicted=list(evict), backend=att.plan.backend
                )
                for a, reason in evict.items():
                    fleet.evict(a, reason)
            raise
        with self.lock:
            self.state.connected(att, group)
        return group

    def _build(self, att: Attempt, made: Callable[[dist.ProcessGroup], None]) -> dist.ProcessGroup:
        # A store client of its own, not `control`: an abandoned rendezvous keeps blocking in it until its timeout.
        backend = att.plan.backend
        with self.build_store.client(self.cfg.host, self.port, self.cfg.timeout_s) as store:
            return wg.open_group(
                store,
                self.cfg.host,
                att.epoch,
                0,
                att.plan.world_size,
                self.cfg.timeout_s,
                backend,
                wg.group_device(backend, self.device),
                made,
                att.plan.lazy,
            )

    def _give_up(self, att: Attempt, side: dist.ProcessGroup | None, error: RuntimeError, elapsed: float) -> None:
        """Tell the members the epoch is over (before returning: the optimizer may write the parameters next)."""
        self.control.set(abort_key(att.epoch), str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
        with self.lock:
            everyone = self.state.gave_up(att)
        dead = side if att.side else everyone
        if dead is not None:
            wg.close_group(dead, att.plan.backend)
        self.staging.drop()  # an abandoned gloo send may still read it: the next epoch stages into fresh memory
        # A newcomer's catch-up is cut short at every update until it joins or its deadline evicts it: its first
        # attempt's failure is the warning, the eviction (hub.actor_removed) counts the attempts.
        (self.log.debug if att.repeat else self.log.warning)(
            "weights.attempt_failed",
            epoch=att.epoch,
            version=att.version,
            members=att.members,
            seconds=round(elapsed, 3),
            error=(str(error).splitlines() or [type(error).__name__])[0][:300],
        )
