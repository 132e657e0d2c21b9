"""`fleetrl actor`: one process per inference engine, on a uvloop event loop. This file: its lifecycle and dispatch.

    actors/session.py  the hub session: connection, Register / Heartbeat / WorkRequest, the connection's health
    actors/served.py   the weights served: their version, applying a WeightSync
    actors/rollout.py  a grant's generating and scoring;  actors/engine.py  vLLM's AsyncLLM

    receiver task:  RegisterAck -> session | WorkGrant -> grant task | EvalGrant -> eval task
                    | WeightSync -> sync task | Shutdown | Error
    grant task:     wait until the engine serves grant.policy_version -> generate n completions
                    -> score (reward worker processes) -> send RolloutGroup (each group as soon as it is done)
    eval task:      EvalGrant -> generate with its sampling (greedy or sampled, eval.*) -> score -> EvalResult
                    (not counted in the session's `held`: eval work never takes the place of training work)
    sync task:      ServedWeights.apply -> WeightVersion -> ask for work
    heartbeat task: HubSession.heartbeat; re-registers when the hub stops answering
    engine task:    vLLM's engine core died on its own (the OOM killer) -> actor.engine_died, stop, exit 1
    watch task:     HubSession.losses: the learner's connection closing -> learner lost; the client key
                    refused -> exit 1
    SIGTERM/SIGINT: cancel the tasks (or the start-up), close, stop the engine, exit 0; if that has not happened
                    within STOP_GRACE_S, SIGKILL every descendant and exit 128 + signal (actors/lifeline.py)

Engine lost (its core process died, or vLLM declared it dead): nothing can generate or load weights any more,
and vLLM never answers an RPC it had sent (a sync's pause or load): the actor stops at once, whatever it awaits
(its tasks are cancelled), and exits 1. The protocol has no goodbye: its connection closing makes the hub put
every prompt it held back in the queue at once.

Learner lost (its connection closed, or it answers unknown_actor): the actor keeps its engine and waits
(actor.waiting_for_learner, registering again with backoff). Work granted before is void: the grant and eval
tasks are cancelled (a resumed learner put those prompts back in its queue). The weights are distrusted until
the learner's next sync (ServedWeights.forget). A sync that fails is not a lost learner: it is logged and
survived like any broken group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any

import uvloop
import zmq.asyncio

from actors import lifeline
from actors.rewards import load_reward
from actors.rewards.pool import RewardPool
from actors.rollout import Rollouts
from actors.served import ServedWeights
from actors.session import HubSession
from protocol import auth
from protocol import messages as m
from protocol.config import Config, parse_cpus
from protocol.logs import setup_logging
from protocol.net import pin_cpus
from protocol.progress import phase

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
        keys = auth.client_keys(cfg, learner)  # CURVE keys, or None on loopback (a bad key file fails here)
        log_file = Path(cfg.run.dir) / "logs" / f"actor-{self.actor_id}.jsonl"
        self.log = setup_logging("actor", log_file, actor_id=self.actor_id, policy_version=0)
        self.weights = ServedWeights(self.actor_id, self.log)
        self.session = HubSession(cfg, learner, self.actor_id, keys, self.weights, self.log)
        self.work: set[asyncio.Task] = set()  # grant and eval tasks: void when the learner is lost
        self.stop = asyncio.Event()
        self.stop_signal: int | None = None  # the SIGTERM or SIGINT that asked for the stop
        self.engine_dead = False  # vLLM's engine core died on its own (said once, in actor.engine_died)
        self.exit_code = 0
        self.tasks: set[asyncio.Task] = set()

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
                self._spawn(self.session.heartbeat())
                self._spawn(self._watch_connection())
                await self.stop.wait()
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.session.close()
            ctx.term()
            if self.rewards is not None:
                await self.rewards.close()
            self.engine.shutdown(ENGINE_STOP_S)
            self.log.info("actor.stopped", exit_code=self.exit_code)
        return self.exit_code

    async def _start(self, ctx: zmq.asyncio.Context) -> None:
        with phase(self.log, "actor.engine_warmup"):
            await self.engine.warm_up()
        devices = await self.engine.devices()
        self.log.info("actor.engine_devices", ranks=len(devices), devices=devices)
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
        self.session.connect(ctx, devices)

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
        self.session.released()
        if not self.stop.is_set():
            self._spawn(self.session.request_work())

    def _lost_learner(self, why: str) -> None:
        """The learner died, restarted or forgot this actor: drop its work, distrust the weights, register again."""
        self.session.lost()
        self.weights.forget()
        for task in list(self.work):
            task.cancel()  # vLLM aborts a cancelled request; the session's `held` drops in _grant_done
        self.log.warning("actor.learner_lost", why=why, learner=self.learner, cancelled=len(self.work))

    async def _watch_connection(self) -> None:
        async with aclosing(self.session.losses()) as losses:
            async for why in losses:
                self._lost_learner(why)
        self.exit_code = 1  # the learner refused this actor's key (logged by the session): final
        self.stop.set()

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
            groups_in_flight=self.session.held,
            syncing=self.weights.syncing,
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
            if self.stop_signal is not None:
                # The stop signal reached the engine core too (Slurm's scancel signals every process of the step): a
                # sync or grant it ends ("Server shutting down") is part of the stop, not a failure.
                self.log.info("actor.task_ended_by_stop", error=repr(exc))
                return
            self.log.error("actor.task_failed", error=repr(exc), exc_info=exc)
            self.exit_code = 1
            self.stop.set()

    async def _receive(self) -> None:
        async with aclosing(self.session.messages()) as messages:
            async for msg in messages:
                if await self._dispatch(msg):
                    return

    async def _dispatch(self, msg: m.Message) -> bool:
        """Act on one message from the hub: whether it was final (the actor stops)."""
        if isinstance(msg, m.WorkGrant | m.EvalGrant | m.WeightSync) and not self.session.is_registered:
            # Sent by a learner this actor has lost (it answers only registered actors): a sync would wait on its
            # dead rendezvous until weights.timeout_s, holding up the next learner's.
            self.log.info("actor.ignored_from_lost_learner", type=type(msg).__name__)
        elif isinstance(msg, m.RegisterAck):
            await self.session.accepted(msg)
        elif isinstance(msg, m.WorkGrant):
            self.session.granted()
            # Released by a done-callback, not the task's own `finally`: a task cancelled before it first ran
            # (grants that arrive in one burst with the news that the learner forgot us) never runs that.
            self._spawn_work(self._run_grant(msg)).add_done_callback(self._grant_done)
        elif isinstance(msg, m.EvalGrant):
            self._spawn_work(self._run_eval(msg))
        elif isinstance(msg, m.WeightSync):
            self.weights.offered(msg)
            self._spawn(self._sync(msg))
        elif isinstance(msg, m.Shutdown):
            self.log.info("actor.shutdown_requested", reason=msg.reason)
            self.stop.set()
        elif isinstance(msg, m.Error):
            if msg.code in ("id_taken", "quarantined"):  # final: another node holds this id, or the hub shut us out
                self.log.error(f"actor.{msg.code}", actor=self.actor_id, detail=msg.detail)
                self.exit_code = 1
                self.stop.set()
                return True
            self.log.warning("actor.hub_error", code=msg.code, detail=msg.detail)
            if msg.code == "unknown_actor" and self.session.is_registered:
                self._lost_learner("unknown to the learner")  # it restarted or dropped us: join again
                await self.session.register()
        else:
            self.log.warning("actor.unexpected_message", type=type(msg).__name__)
        return False

    async def _run_grant(self, grant: m.WorkGrant) -> None:
        await self.weights.serving(grant.policy_version)
        assert self.rollouts is not None
        await self.session.send(await self.rollouts.train_group(grant, self.actor_id, lambda: self.weights.version))

    async def _run_eval(self, grant: m.EvalGrant) -> None:
        await self.weights.serving(grant.policy_version)
        assert self.rollouts is not None
        await self.session.send(await self.rollouts.eval_result(grant, self.actor_id, lambda: self.weights.version))

    async def _sync(self, sync: m.WeightSync) -> None:
        if await self.weights.apply(sync, self.engine, self.session.send):
            await self.session.request_work()


def run_actor(cfg: Config, learner: str, actor_id: str | None = None) -> int:
    pin_cpus(parse_cpus(cfg.actor.cpu_affinity, "actor.cpu_affinity"))  # inherited by vLLM's processes
    lifeline.root()  # before the engine: its processes die with this one, whatever kills it

    async def main() -> int:
        return await Actor(cfg, learner, actor_id).run()

    return uvloop.run(main())
