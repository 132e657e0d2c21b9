"""An actor's processes end with it, whatever ends it: real `fleetrl actor` processes with their vLLM engines, and no
learner (an actor starts its engine before it dials one). The mechanism: actors/lifeline.py.

- SIGKILL, as the OOM killer sends it: the engine core and the reward workers go within seconds (they used to
  live on, holding the engine's memory).
- SIGTERM while vLLM starts the engine (the event loop is blocked): the actor and its children are gone after the
  stop's grace, exit 143 (it used to finish the start first, and more).
- SIGTERM to the process group, as the demo launcher sends it, as the warm-up begins: the engine core dies under
  the warm-up request, and the actor stops cleanly at once (it used to wait on that request forever), without a
  word about AsyncLLM.__del__ at exit.
"""

import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import alive, command

from actors.main import STOP_GRACE_S
from bench.fleet import Fleet

pytestmark = pytest.mark.engine

TINY = ["actor.kvcache_gib=1", "rollout.samples_per_prompt=2"]
EXIT_S = STOP_GRACE_S + 4.0  # a stop signal to the actor and its children gone, at most


def still_alive_after(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{p.pid} {p.name()}" for p in left if alive(p)]


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def test_a_killed_actor_takes_its_processes_with_it(tmp_path, tiny_model_dir):
    fleet = Fleet(tmp_path / "run", tiny_model_dir, TINY)
    try:
        actor = fleet.start_actor("victim")
        fleet.wait_for("victim", "actor.reward_workers_start.done", timeout=400)
        procs = tree(actor)
        names = [command(p) for p in procs]
        assert sum("EngineCore" in n for n in names) == 1, names
        assert sum("actors.rewards.worker" in n for n in names) == fleet.cfg.rollout.reward_workers, names
        os.kill(actor.pid, signal.SIGKILL)  # the actor alone (its group is left alone), as the OOM killer would
        assert actor.wait(10) == -signal.SIGKILL
        assert not still_alive_after(procs, 5.0)
    finally:
        fleet.stop_all()  # left-overs keep the actor's process group


def test_sigterm_stops_a_starting_actor_and_its_processes(tmp_path, tiny_model_dir):
    """Two actors at once, for one engine start's wait; a Fleet each, since each wait_for fails on its own fleet's
    processes exiting non-zero."""
    starting = Fleet(tmp_path / "starting", tiny_model_dir, TINY)
    warming = Fleet(tmp_path / "warming", tiny_model_dir, TINY)
    try:
        first, second = starting.start_actor("starting"), warming.start_actor("warming")

        # 1. SIGTERM to the actor alone once vLLM has spawned its engine core: the engine start blocks the loop.
        deadline = time.monotonic() + 300
        while not (procs := [p for p in tree(first) if "multiprocessing.spawn" in command(p)]):
            assert time.monotonic() < deadline and first.poll() is None, "no engine core process"
            time.sleep(0.05)
        time.sleep(1.0)
        procs = tree(first)
        assert not starting.find("starting", "actor.engine_start.done")
        os.kill(first.pid, signal.SIGTERM)
        t0 = time.monotonic()
        assert first.wait(EXIT_S) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < EXIT_S
        assert not still_alive_after(procs, 1.0)
        assert starting.find("starting", "actor.stop_overdue", lambda e: e["signal"] == "SIGTERM")

        # 2. SIGTERM to the process group as the warm-up begins: the engine core gets it too and exits.
        warming.wait_for("warming", "actor.engine_warmup.begin", timeout=400, poll_s=0.001)
        procs = tree(second)
        assert any("EngineCore" in command(p) for p in procs), [command(p) for p in procs]
        warming.kill("warming", signal.SIGTERM)
        assert second.wait(EXIT_S) == 0  # a clean stop
        assert not still_alive_after(procs, 1.0)
        assert warming.find("warming", "actor.stopped")
        out = warming.output("warming")
        assert "AsyncLLM.__del__" not in out and "TypeError" not in out, out[-3000:]
    finally:
        starting.stop_all()
        warming.stop_all()
