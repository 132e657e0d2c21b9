"""actors/lifeline.py without vLLM: process trees made as the actor makes them (tests/drivers/lifeline_tree.py).

- A SIGKILLed root takes its spawned children (and theirs) and its children forked from the main thread with it.
- A child forked from another thread is not attached: that thread's end does not kill it.
- A child whose actor is gone before it attaches kills itself; one whose actor is an ancestor carries on.
- A stop signal to a root whose main thread never acts on it ends the root and its children after the grace,
  exit 128 + the signal; a SIGINT on top cuts the grace short, a second SIGTERM does not (it is the same stop).
- A root that stops cleanly does so under two SIGTERMs milliseconds apart, as Slurm's scancel delivers them.
The same with a real actor and its vLLM engine: tests/integration/test_actor_exit.py.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import alive

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(ROOT / "tests" / "drivers" / "lifeline_tree.py")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def still_alive_after(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, DRIVER, *args], stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_children_die_with_their_root_but_not_with_a_thread():
    root = start("tree")
    try:
        pids = json.loads(root.stdout.readline())
        procs = {role: psutil.Process(pid) for role, pid in pids.items()}
        # The thread that forked `forked_in_thread` has ended: an attached child would be dead by now.
        time.sleep(0.3)
        assert alive(procs["forked_in_thread"])
        assert procs["grandchild"].ppid() == pids["spawned"]
        os.kill(root.pid, signal.SIGKILL)
        root.wait(5)
        attached = [procs[r] for r in ("spawned", "grandchild", "forked")]
        assert not still_alive_after(attached, 3.0), {r: alive(p) for r, p in procs.items()}
        assert alive(procs["forked_in_thread"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)  # whatever is left keeps the root's process group


@pytest.mark.parametrize("actor_is_ancestor", [True, False])
def test_a_child_whose_actor_is_gone_kills_itself_as_it_attaches(actor_is_ancestor):
    """FLEETRL_LIFELINE names the actor. Here it is this test process (an ancestor), or a live process that is not
    an ancestor, as a child finds it whose actor died before it attached (the pid may even be taken by then)."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        env = {**os.environ, "FLEETRL_LIFELINE": str(os.getpid() if actor_is_ancestor else other.pid)}
        child = subprocess.run(
            [sys.executable, "-c", "from actors import lifeline; lifeline.attach(); print('attached')"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        other.kill()
        other.wait()
    if actor_is_ancestor:
        assert (child.returncode, child.stdout) == (0, "attached\n"), child.stderr
    else:
        assert (child.returncode, child.stdout) == (-signal.SIGKILL, ""), child.stderr


TERM, INT = signal.SIGTERM, signal.SIGINT


@pytest.mark.parametrize("signals", [(TERM,), (TERM, TERM), (INT, INT), (TERM, INT)], ids=["TERM", "TERM-TERM", "INT-INT", "TERM-INT"])
def test_a_stop_signal_ends_a_stuck_root_and_its_children(signals):
    forced = INT in signals[1:]  # Ctrl-C twice ends it at once; a repeated SIGTERM is the same stop and waits out the grace
    grace_s = 30.0 if forced else 1.5
    root = start("stop", str(grace_s))
    try:
        word, child_pid = root.stdout.readline().split()
        assert word == "ready"
        child = psutil.Process(int(child_pid))
        t0 = time.monotonic()
        for sig in signals:
            os.kill(root.pid, sig)
            time.sleep(0.2)
        assert root.wait(grace_s + 5) == 128 + signals[0]
        took = time.monotonic() - t0
        assert took < 5 if forced else grace_s <= took < grace_s + 3, took  # forced: far under its 30 s grace
        assert root.stdout.read() == f"overdue {int(signals[0])} 1\n"
        assert not still_alive_after([child], 1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)


def test_two_sigterms_at_once_are_one_clean_stop():
    """scancel signals every process of a Slurm step and deploy/actors.sh signals the actor's group: two SIGTERMs
    milliseconds apart. Before, the second was taken as "kill now" and the actor logged actor.stop_overdue."""
    root = start("clean", "8")
    try:
        assert root.stdout.readline().split()[0] == "ready"
        os.kill(root.pid, TERM)
        time.sleep(0.005)
        os.kill(root.pid, TERM)
        assert root.wait(10) == 0
        assert root.stdout.read() == f"stopping {int(TERM)}\n"  # no "overdue": the clean stop ran to its end
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)
