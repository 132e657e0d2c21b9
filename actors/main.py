"""`fleetrl actor`: one process per inference engine, on a uvloop event loop.

    receiver task:  RegisterAck | WorkGrant -> grant task | WeightSync -> sync task | Shutdown | Error
    grant task:     wait until the engine serves grant.policy_version -> generate n completions
                    -> score (reward worker processes) -> send RolloutGroup (each group as soon as it is done;
                    generating and scoring: actors/rollout.py)
    eval task:      EvalGrant -> generate with its sampling (greedy or sampled, eval.*) -> score -> EvalResult
                    (not counted in `held`: eval work never takes the place of training work)
    sync task:      pause engine (keep in-flight) -> receive buckets -> load -> resume -> WeightVersion
                    (a failed sync is logged and survived: the learner forms a new group epoch and sends again)
    heartbeat task: Heartbeat every hub.heartbeat_s; re-registers when the hub stops answering
    engine task:    vLLM's engine core died on its own (the OOM killer) -> actor.engine_died, stop, exit 1
    watch task:     the learner's connection closing (it died or restarted) -> learner lost; a failed CURVE
                    handshake -> its likely cause, logged (a refused client key is final: exit 1)
    SIGTERM/SIGINT: cancel the tasks (or the start-up), close, stop the engine, exit 0; if that has not happened
                    within STOP_GRACE_S, SIGKILL every descendant and exit 128 + signal (actors/lifeline.py)

Engine lost (its core process died, or vLLM declared it dead): nothing can generate or load weights any more,
and vLLM never answers an RPC it had sent (a sync's pause or load): the actor stops at once, whatever it awaits
(its tasks are cancelled), and exits 1. The protocol has no goodbye: its connection closing makes the hub put
every prompt it held back in the queue at once.

Learner lost (its connection closed, or it answers unknown_actor): the actor keeps its engine
and waits (actor.waiting_for_learner, registering again with backoff). Work granted before is
void: the grant and eval tasks are cancelled (a resumed learner put those prompts back in its
queue). The weights it holds may come from versions the resumed learner will train again
differently, so it serves version -1 until the learner's next sync, and its worker leaves the
old weight group (a new learner has a new rendezvous). A sync that fails is not a lost learner:
it is logged and survived like any broken group.

A sample's version_min is the version served when its generation started; the
served version is bumped only after new weights are loaded, so a sample is never
tagged newer than the weights that produced it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any

import uvloop
import zmq
import zmq.asyncio

from actors import lifeline
from actors.rewards import load_reward
from actors.rewards.pool import RewardPool
from actors.rollout import Rollouts
from protocol import auth, transport
from protocol import messages as m
from protocol.config import Config, parse_cpus
from protocol.logs import set_context, setup_logging
from protocol.net import pin_cpus
from protocol.progress import phase

# What the actor hears from its connection's monitor: a closed connection, a failed or completed CURVE handshake.
CONNECTION_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
# SIGTERM/SIGINT to exit, at most: the clean stop, else SIGKILL to everything the actor started (actors/lifeline.py).
# Above ENGINE_STOP_S plus the rest of a clean stop (closing the reward workers and the socket).
STOP_GRACE_S = 8.0
# SIGTERM to vLLM's engine core to SIGKILL of its process tree. It is done with the engine well within this; the
# rest is its interpreter's teardown, and the memory it holds (a GPU's included) is freed when it dies either way.
ENGINE_STOP_S = 3.0
# How often the actor looks at vLLM's engine-dead flag (set the moment the engine core process ends): the bound on
# noticing an engine core that died on its own while nothing in flight would fail (an RPC, or no work at all).
ENGINE_WATCH_S = 0.5


class Actor:
    def __init__(self, cfg: Config, learner: str, actor_id: str | None = None):
        self.cfg = cfg
        self.learner = learner
        self.actor_id = actor_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        load_reward(cfg.rollout.reward_fn)  # fails here, naming rollout.reward_fn, before the engine's slow start
        self.rewards: RewardPool | None = None  # the worker processes that score (started after the engine)
        self.rollouts: Rollouts | None = None  # grants -> scored groups (actors/rollout.py), once engine and rewards are up
        self.keys = auth.client_keys(cfg, learner)  # CURVE keys, or None on loopback (a bad key file fails here)
        self.served_version = 0  # the weights in model.path are the learner's version 0
        self.version_changed = asyncio.Condition()
        self.sync_lock = asyncio.Lock()
        self.newest_group: tuple[str, int, int] | None = None  # (store host, port, epoch) of the last WeightSync received
        self.held = 0
        self.work: set[asyncio.Task] = set()  # grant and eval tasks: void when the learner is lost
        self.lost = 0  # times the learner was lost; a sync started before a loss must not set served_version
        self.leave_group = False  # the worker must drop its weight group and store before the next sync
        self.synced = 0  # weight syncs applied
        self.devices: list[str] = []  # each engine worker's device identity: its weight-group ranks (set at start)
        self.registered = asyncio.Event()
        self.stop = asyncio.Event()
        self.stop_signal: int | None = None  # the SIGTERM or SIGINT that asked for the stop
        self.engine_dead = False  # vLLM's engine core died on its own (said once, in actor.engine_died)
        self.handshake_error: str | None = None  # why the last CURVE handshake with the learner failed (auth.handshake_failure)
        self.exit_code = 0
        self.tasks: set[asyncio.Task] = set()
        self.sock: zmq.asyncio.Socket | None = None  # the connection to the hub, made once the engine is up
        log_file = Path(cfg.run.dir) / "logs" / f"actor-{self.actor_id}.jsonl"
        self.log = setup_logging("actor", log_file, actor_id=self.actor_id, policy_version=0)

    async def run(self) -> int:
        from actors.engine import Engine

        loop = asyncio.get_running_loop()
        lifeline.stop_on_signals(lambda signum: self._stop_requested(loop, signum), STOP_GRACE_S, self._stop_overdue)
        try:
            with phase(self.log, "actor.engine_start", model=self.cfg.model.path):  # blocks the loop; the ticker is a thread
                self.engine = Engine(self.cfg)
        except Exception:
            if self.stop_signal is None:
                raise
            # The stop signal reached the engine core too (a launcher signals the whole process group): not a failure.
            self.log.info("actor.stopped", exit_code=self.exit_code, during="engine start")
            return self.exit_code
        ctx = zmq.asyncio.Context()
        try:
            self._spawn(self._watch_engine())  # from the warm-up on: a start-up step may wait on a dead engine for good
            if await self._unless_stopped(self._start(ctx)):
                self._spawn(self._receive())
                self._spawn(self._heartbeat())
                self._spawn(self._watch_connection())
                await self.stop.wait()
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if self.sock is not None:
                self.sock.close(linger=0)
            ctx.term()
            if self.rewards is not None:
                await self.rewards.close()
            self.engine.shutdown(ENGINE_STOP_S)
            self.log.info("actor.stopped", exit_code=self.exit_code)
        return self.exit_code

    async def _start(self, ctx: zmq.asyncio.Context) -> None:
        with phase(self.log, "actor.engine_warmup"):
            await self.engine.warm_up()
        self.devices = await self.engine.devices()
        self.log.info("actor.engine_devices", ranks=len(self.devices), devices=self.devices)
        # After the engine: a process it forks must not inherit the workers' sockets (a worker whose socket is
        # also held elsewhere would not see the actor die).
        r = self.cfg.rollout
        self.rewards = RewardPool(
            r.reward_fn,
            r.reward_workers,
            r.reward_timeout_s,
            on_replace=lambda why: self.log.warning("actor.reward_worker_replaced", reward=r.reward_fn, why=why),
        )
        with phase(self.log, "actor.reward_workers_start", workers=r.reward_workers):
            await self.rewards.start()
        self.rollouts = Rollouts(self.cfg, self.engine, self.rewards, self.log)
        self.sock = transport.client_socket(
            ctx, self.learner, self.cfg.hub.hwm, self.cfg.hub.max_frame_bytes, self.keys, events=CONNECTION_EVENTS
        )

    async def _unless_stopped(self, coro) -> bool:
        """Run a start-up step unless the stop comes first (then cancel it): whether it ran. A step can wait forever on
        an engine core that died (the stop signal reaches it too when it is sent to the actor's process group)."""
        step, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({step, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)  # it cleans up (a reward worker half started)
            return False
        if step.exception() is not None and self.stop_signal is not None:
            self.log.info("actor.start_cut_short", error=repr(step.exception()))  # the engine core got the signal first
            return False
        if step.exception() is not None and (death := self.engine.death()) is not None:
            self._engine_died(death)  # the cause, in one line; the step's EngineDeadError says nothing more
            return False
        step.result()  # its error, if it failed
        return True

    def _stop_requested(self, loop: asyncio.AbstractEventLoop, signum: int) -> None:
        """In the signal handler (actors/lifeline.py): record, and wake the loop (busy starting the engine, it sees it later)."""
        self.stop_signal = signum
        loop.call_soon_threadsafe(self._stop_by_signal, signum)

    def _stop_by_signal(self, signum: int) -> None:
        self.log.info("actor.stop_requested", signal=signal.Signals(signum).name, grace_s=STOP_GRACE_S)
        self.stop.set()

    def _stop_overdue(self, signum: int, killed: int) -> None:
        """From the deadline thread, just before the actor exits 128 + signum."""
        self.log.error("actor.stop_overdue", signal=signal.Signals(signum).name, grace_s=STOP_GRACE_S, killed_processes=killed)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _spawn_work(self, coro) -> asyncio.Task:
        task = self._spawn(coro)
        self.work.add(task)
        task.add_done_callback(self.work.discard)
        return task

    def _grant_done(self, task: asyncio.Task) -> None:
        """A grant's task ended (done, failed or cancelled): its slot is free; ask for more unless stopping."""
        self.held -= 1
        if not self.stop.is_set():
            self._spawn(self._request_work())

    def _lost_learner(self, why: str) -> None:
        """The learner died, restarted or forgot this actor: drop its work, distrust the weights, register again."""
        self.lost += 1
        self.registered.clear()
        self.served_version = -1
        self.leave_group = True
        self.newest_group = None  # syncs of the lost learner still queued behind the sync lock are skipped
        set_context(policy_version=-1)
        for task in list(self.work):
            task.cancel()  # vLLM aborts a cancelled request; `held` drops in _grant_done
        self.log.warning("actor.learner_lost", why=why, learner=self.learner, cancelled=len(self.work))

    async def _watch_connection(self) -> None:
        """The connection's events, from its one monitor (libzmq allows one per socket):
        - closed: the first sign of a dead learner (a restarted one would answer unknown_actor);
        - key refused: final (libzmq does not retry a refused handshake), so say so and exit non-zero
          instead of waiting forever;
        - handshake dropped (another server key, most likely): libzmq retries it on every reconnect, so the
          actor says why once here, and again in every actor.waiting_for_learner line until one succeeds."""
        assert self.sock is not None
        async with aclosing(transport.socket_events(self.sock, CONNECTION_EVENTS)) as events:
            async for event in events:
                kind, value = event["event"], int(event["value"])
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.handshake_error = None
                    continue
                cause = auth.handshake_failure(kind, value, client_curve=self.keys is not None)
                if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.log.error(
                        "actor.key_refused",
                        learner=self.learner,
                        status=value,
                        key=self.cfg.auth.client_key,
                        cause=cause,
                        hint="add its public key to the learner's auth.authorized folder (fleetrl keys), then restart this actor",
                    )
                    self.exit_code = 1
                    self.stop.set()
                    return
                if cause is not None:
                    if cause != self.handshake_error:
                        self.log.error("actor.handshake_failed", learner=self.learner, server_key=self.cfg.auth.server_key, cause=cause)
                    self.handshake_error = cause
                elif kind == zmq.EVENT_DISCONNECTED and self.registered.is_set():
                    self._lost_learner("connection closed")

    async def _watch_engine(self) -> None:
        while (death := self.engine.death()) is None:
            await asyncio.sleep(ENGINE_WATCH_S)
        self._engine_died(death)

    def _engine_died(self, death: dict[str, Any]) -> None:
        """Log the cause once and stop, exit 1. Not when a stop signal was sent: a launcher signals the whole process
        group, and the engine core ending then is expected."""
        if self.stop_signal is not None or self.engine_dead:
            return
        self.engine_dead = True
        self.log.error(
            "actor.engine_died",
            **death,
            groups_in_flight=self.held,
            syncing=self.sync_lock.locked(),
            hint="vLLM's engine core ended on its own; a SIGKILL is most likely the OOM killer (see dmesg): give it more "
            "memory or lower actor.kvcache_gib, actor.max_num_seqs or actor.gpu_memory_utilization, then start the actor "
            "again. The prompts it held go back to the learner's queue.",
        )
        self.exit_code = 1
        self.stop.set()

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if (death := self.engine.death()) is not None:  # EngineDeadError in a grant or sync: a consequence, not the cause
                self._engine_died(death)
                return
            self.log.error("actor.task_failed", error=repr(exc), exc_info=exc)
            self.exit_code = 1
            self.stop.set()

    async def _send(self, msg: m.Message) -> None:
        assert self.sock is not None
        await transport.send(self.sock, msg)

    async def _register(self) -> None:
        self.registered.clear()
        await self._send(
            m.Register(
                actor_id=self.actor_id, host=socket.gethostname(), pid=os.getpid(), served_version=self.served_version, devices=self.devices
            )
        )

    async def _request_work(self) -> None:
        """Ask for work while there is room; the request names the actor's whole capacity (the hub subtracts
        what it has granted and not yet received back: requests in flight cannot make it grant twice)."""
        if self.held < self.cfg.actor.max_groups and self.registered.is_set():
            await self._send(m.WorkRequest(actor_id=self.actor_id, max_prompts=self.cfg.actor.max_groups))

    async def _heartbeat(self) -> None:
        backoff = 1.0
        await self._register()
        while True:
            try:
                await asyncio.wait_for(self.registered.wait(), timeout=backoff)
            except TimeoutError:
                # A failed handshake is the likely cause; without one nothing answered at that address (a refused client
                # key never gets here: the watch task stops the actor).
                why = {"cause": self.handshake_error} if self.handshake_error else {"hint": "is the learner up, at this address?"}
                self.log.warning("actor.waiting_for_learner", learner=self.learner, retry_s=backoff, curve=self.keys is not None, **why)
                backoff = min(backoff * 2, 30.0)
                await self._register()
                continue
            backoff = 1.0
            await self._send(m.Heartbeat(actor_id=self.actor_id, served_version=self.served_version, groups_in_flight=self.held))
            await self._request_work()
            await asyncio.sleep(self.cfg.hub.heartbeat_s)

    async def _receive(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = transport.decode_frames(frames, self.cfg.hub.max_frame_bytes)
            except m.ProtocolError as e:  # count, log, carry on: bad input never kills the actor
                self.log.warning("actor.bad_message", error=str(e))
                continue
            if isinstance(msg, m.WorkGrant | m.EvalGrant | m.WeightSync) and not self.registered.is_set():
                # Sent by a learner this actor has lost (it answers only registered actors): a sync would wait on its
                # dead rendezvous until weights.timeout_s, holding up the next learner's.
                self.log.info("actor.ignored_from_lost_learner", type=type(msg).__name__)
            elif isinstance(msg, m.RegisterAck):
                if not self.registered.is_set():
                    self.registered.set()
                    self.log.info("actor.registered", learner_version=msg.policy_version)
                    await self._request_work()
            elif isinstance(msg, m.WorkGrant):
                self.held += 1
                # Released by a done-callback, not the task's own `finally`: a task cancelled before it first ran
                # (grants that arrive in one burst with the news that the learner forgot us) never runs that.
                self._spawn_work(self._run_grant(msg)).add_done_callback(self._grant_done)
            elif isinstance(msg, m.EvalGrant):
                self._spawn_work(self._run_eval(msg))
            elif isinstance(msg, m.WeightSync):
                self.newest_group = (msg.store_host, msg.store_port, msg.group_epoch)
                self._spawn(self._apply_sync(msg))
            elif isinstance(msg, m.Shutdown):
                self.log.info("actor.shutdown_requested", reason=msg.reason)
                self.stop.set()
            elif isinstance(msg, m.Error):
                if msg.code in ("id_taken", "quarantined"):  # final: another node holds this id, or the hub shut us out
                    self.log.error(f"actor.{msg.code}", actor=self.actor_id, detail=msg.detail)
                    self.exit_code = 1
                    self.stop.set()
                    return
                self.log.warning("actor.hub_error", code=msg.code, detail=msg.detail)
                if msg.code == "unknown_actor" and self.registered.is_set():
                    self._lost_learner("unknown to the learner")  # it restarted or dropped us: join again
                    await self._register()
            else:
                self.log.warning("actor.unexpected_message", type=type(msg).__name__)

    async def _run_grant(self, grant: m.WorkGrant) -> None:
        await self._serving(grant.policy_version)
        assert self.rollouts is not None
        await self._send(await self.rollouts.train_group(grant, self.actor_id, lambda: self.served_version))

    async def _run_eval(self, grant: m.EvalGrant) -> None:
        await self._serving(grant.policy_version)
        assert self.rollouts is not None
        await self._send(await self.rollouts.eval_result(grant, self.actor_id, lambda: self.served_version))

    async def _serving(self, version: int) -> None:
        """Until the engine serves `version` (a grant's: the hub grants only what the weights it sent can make)."""
        async with self.version_changed:
            await self.version_changed.wait_for(lambda: self.served_version >= version)

    async def _apply_sync(self, sync: m.WeightSync) -> None:
        async with self.sync_lock:
            if (sync.store_host, sync.store_port, sync.group_epoch) != self.newest_group:
                # The learner sends a new epoch only after it is done with the old one, so a sync of an older
                # group is abandoned (queued behind one that failed slowly, e.g. while our link was down):
                # joining it would cost a timeout. Within one group every broadcast must be received, in order.
                self.log.info("actor.weights_skipped", version=sync.policy_version, epoch=sync.group_epoch, newer=self.newest_group)
                return
            t0 = time.perf_counter()
            lost, leave, self.leave_group = self.lost, self.leave_group, False
            result = await self.engine.apply_weights(sync, leave_group=leave)
            if "error" in result:
                # The group broke (a member died, the link to the learner was down, or the learner died). The
                # learner gives the epoch up and sends again in a new one (learner/weights/sync.py); until then we serve the
                # old version (or nothing, paused, if some buckets were loaded) and the hub grants us nothing newer.
                # A learner that is gone shows as a closed connection (the watch task), not here.
                self.log.warning(
                    "actor.weights_failed",
                    version=sync.policy_version,
                    epoch=sync.group_epoch,
                    served=self.served_version,
                    paused=result["buckets_loaded"] > 0,
                    **result,
                )
                return
            if lost != self.lost:  # weights of a learner that is gone: keep serving -1 until the next one's sync
                self.log.info("actor.stale_sync_ignored", version=sync.policy_version, epoch=sync.group_epoch)
                return
            first = self.synced == 0
            self.synced += 1
            async with self.version_changed:
                self.served_version = sync.policy_version
                self.version_changed.notify_all()
            set_context(policy_version=sync.policy_version)
            load_s = time.perf_counter() - t0
            # The first sync is the join (a late joiner's catch-up); later ones are routine, every update.
            (self.log.info if first else self.log.debug)(
                "actor.weights_loaded", version=sync.policy_version, epoch=sync.group_epoch, load_s=round(load_s, 4), **result
            )
            await self._send(
                m.WeightVersion(actor_id=self.actor_id, served_version=sync.policy_version, group_epoch=sync.group_epoch, load_s=load_s)
            )
        await self._request_work()


def run_actor(cfg: Config, learner: str, actor_id: str | None = None) -> int:
    pin_cpus(parse_cpus(cfg.actor.cpu_affinity, "actor.cpu_affinity"))  # inherited by vLLM's processes
    lifeline.root()  # before the engine: its processes die with this one, whatever kills it

    async def main() -> int:
        return await Actor(cfg, learner, actor_id).run()

    return uvloop.run(main())
