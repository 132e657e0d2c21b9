"""An actor whose vLLM engine core dies on its own, as when the OOM killer picks it: real `fleetrl actor` processes
against real hubs, the engine core SIGKILLed alone. The actor says so in one line (actor.engine_died, with the
signal), exits 1 within seconds, leaves no process behind, and its closed connection makes the hub put every
prompt it held back in the queue.

- generating: three grants in flight in the engine (frozen with SIGSTOP before the actor registers, so that
  they are). vLLM fails them with EngineDeadError; the actor used to log a traceback per grant instead of the cause.
- loading weights: a WeightSync in flight inside the engine (its worker waits in the weight group's rendezvous),
  no grant held. vLLM never answers an RPC to a dead engine core: the actor used to wait on it for good,
  heartbeating, so the hub kept it as a live member.

And one that is stopped, not killed: SIGTERM to its process group, as a Slurm preemption signals every process of
the step, while its worker waits in a sync's receive. It stops cleanly, exit 0, within the stop's grace. It used
to resume the paused engine first, an RPC the engine core answers only after the receive (weights.timeout_s), and
was SIGKILLed at the grace's end (actor.stop_overdue, in CI's Slurm preemption test).

The three actors start at once, for one engine start's wait.
"""

import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import alive, command, settled, unserved_sync, wait_until

from actors.main import STOP_GRACE_S
from bench.fleet import Fleet
from learner.hub.core.ledger import State
from protocol import weights as wg
from protocol.abortable import joined_key

pytestmark = pytest.mark.engine

MAX_GROUPS = 3
# Engine core killed to actor exited, at most: vLLM notices at once, then the actor's clean stop (about 1 s here).
# Generous for a loaded machine; the old actor waited forever in the sync case.
EXIT_S = 30.0
TINY = ["actor.kvcache_gib=1", "rollout.samples_per_prompt=2", f"actor.max_groups={MAX_GROUPS}"]


def engine_core(fleet: Fleet, actor: subprocess.Popen, name: str) -> tuple[psutil.Process, list[psutil.Process]]:
    """The actor's engine core and all its processes, once it is warmed up (it registers next)."""
    fleet.wait_for(name, "actor.reward_workers_start.done", timeout=400)
    procs = psutil.Process(actor.pid).children(recursive=True)
    (core,) = [p for p in procs if "EngineCore" in command(p)]
    return core, procs


def kill_and_check_exit(fleet: Fleet, actor: subprocess.Popen, name: str, core: psutil.Process, procs: list[psutil.Process]) -> dict:
    os.kill(core.pid, signal.SIGKILL)  # the engine core alone, as the OOM killer would
    t0 = time.monotonic()
    try:
        code = actor.wait(EXIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} still runs {EXIT_S} s after its engine core died:\n{fleet.output(name)[-3000:]}") from None
    assert code == 1 and time.monotonic() - t0 < EXIT_S, fleet.output(name)[-3000:]
    (died,) = fleet.find(name, "actor.engine_died")
    assert (died["process"], died["exit_code"], died["signal"]) == ("EngineCore", -signal.SIGKILL, "SIGKILL")
    assert not fleet.find(name, "actor.task_failed"), "one line with the cause, not a traceback per task"
    assert fleet.find(name, "actor.stopped", lambda e: e["exit_code"] == 1)
    # Children that die of PDEATHSIG (actors/lifeline.py) do so just after the actor: give them a moment.
    wait_until(lambda: not any(alive(p) for p in procs), lambda: f"processes left: {[p.pid for p in procs if alive(p)]}", timeout_s=10)
    return died


def test_an_actor_whose_engine_core_dies_exits_and_its_prompts_go_back(tmp_path, tiny_model_dir, start_hub):
    generating = Fleet(tmp_path / "generating", tiny_model_dir, TINY)
    loading = Fleet(tmp_path / "loading", tiny_model_dir, TINY)
    stopping = Fleet(tmp_path / "stopping", tiny_model_dir, TINY)
    busy_hub = start_hub(f"hub.bind={generating.addr}", "rollout.samples_per_prompt=2", "train.prompts_per_step=8")
    sync_hub = start_hub(f"hub.bind={loading.addr}", "rollout.samples_per_prompt=2", "train.prompts_per_step=8")
    stop_hub = start_hub(f"hub.bind={stopping.addr}", "rollout.samples_per_prompt=2", "train.prompts_per_step=8")
    sync_hub.finish_update(1, [])  # the learner is at version 1: the actor, at 0, gets no grant before its sync
    stop_hub.finish_update(1, [])
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=60)  # the weight group's rendezvous; rank 0 never comes
    try:
        busy, syncing = generating.start_actor("busy"), loading.start_actor("syncing")
        stopped = stopping.start_actor("stopped")

        # 1. Grants in flight in the engine.
        core, procs = engine_core(generating, busy, "busy")
        core.send_signal(signal.SIGSTOP)

        def held() -> list:
            with busy_hub.cond:
                return sorted(busy_hub.actors["busy"].held) if "busy" in busy_hub.actors else []

        wait_until(lambda: len(held()) == MAX_GROUPS, lambda: f"the actor holds {held()}")
        # A group the engine had finished before it was stopped may still be on its way (scored, then sent): its
        # key is received then, and the actor asks for another. What it holds once nothing moves for 1 s is stuck.
        keys = settled(held, "the actor's leases", 1.0)
        assert len(keys) == MAX_GROUPS, keys
        died = kill_and_check_exit(generating, busy, "busy", core, procs)
        assert (died["groups_in_flight"], died["syncing"]) == (MAX_GROUPS, False)
        wait_until(lambda: "busy" not in busy_hub.actors, "the hub still holds the dead actor", 5.0)  # its connection closed
        with busy_hub.cond:
            assert [busy_hub.ledger.entries[key].state for key in keys] == [State.PENDING] * MAX_GROUPS
            assert busy_hub.ledger.counts["requeued_dead"] == MAX_GROUPS
            assert busy_hub.ledger.state_counts()["granted"] == 0
            busy_hub.ledger.check()

        # 2. A weight sync in flight in the engine: its worker has joined the group epoch and waits for rank 0.
        core, procs = engine_core(loading, syncing, "syncing")
        wait_until(lambda: "syncing" in sync_hub.live_actors(), "the actor did not register")
        sync = unserved_sync(store.port)
        sync_hub.send_weight_sync(["syncing"], lambda _: sync)
        wait_until(lambda: store.check([joined_key(1, 1)]), "the engine's worker did not join the weight group")
        died = kill_and_check_exit(loading, syncing, "syncing", core, procs)
        assert (died["groups_in_flight"], died["syncing"]) == (0, True)
        wait_until(lambda: "syncing" not in sync_hub.actors, "the hub still holds the dead actor", 5.0)
        with sync_hub.cond:
            assert sync_hub.ledger.state_counts()["granted"] == 0

        # 3. A stop signal while a sync waits in the receive.
        procs = psutil.Process(stopped.pid).children(recursive=True)
        wait_until(lambda: "stopped" in stop_hub.live_actors(), "the actor did not register")
        stop_hub.send_weight_sync(["stopped"], lambda _: unserved_sync(store.port, epoch=2))
        wait_until(lambda: store.check([joined_key(2, 1)]), "the engine's worker did not join the weight group")
        t0 = time.monotonic()
        stopping.kill("stopped", signal.SIGTERM)  # the group: the engine core and its worker get it too
        try:
            code = stopped.wait(STOP_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the actor still runs {STOP_GRACE_S + 5} s after SIGTERM:\n{stopping.output('stopped')[-3000:]}"
            ) from None
        assert code == 0, stopping.output("stopped")[-3000:]
        assert time.monotonic() - t0 < STOP_GRACE_S
        assert not stopping.find("stopped", "actor.stop_overdue")
        assert stopping.find("stopped", "actor.stopped", lambda e: e["exit_code"] == 0)
        wait_until(lambda: not any(alive(p) for p in procs), lambda: f"processes left: {[p.pid for p in procs if alive(p)]}", timeout_s=10)
    finally:
        generating.stop_all()
        loading.stop_all()
        stopping.stop_all()
