"""actors/lifeline.py without vLLM: process trees made as the actor makes them (tests/drivers/lifeline_tree.py).

- A SIGKILLed root takes its spawned children (and theirs) and its children forked from the main thread with it.
- A child forked from another thread is not attached: that thread's end does not kill it.
- A child whose actor is gone before it attaches kills itself; one whose actor is an ancestor carries on.
- A stop signal to a root whose main thread never acts on it ends the root and its children after the grace,
  exit 128 + the signal; a second signal cuts the grace short.
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

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(ROOT / "tests" / "drivers" / "lifeline_tree.py")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # a zombie is dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return False


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


@pytest.mark.parametrize("signals", [1, 2])
def test_a_stop_signal_ends_a_stuck_root_and_its_children(signals):
    grace_s = 1.5 if signals == 1 else 30.0  # two signals: the second one must not wait for the grace
    root = start("stop", str(grace_s))
    try:
        word, child_pid = root.stdout.readline().split()
        assert word == "ready"
        child = psutil.Process(int(child_pid))
        t0 = time.monotonic()
        for _ in range(signals):
            os.kill(root.pid, signal.SIGTERM)
            time.sleep(0.2)
        assert root.wait(grace_s + 5) == 128 + signal.SIGTERM
        took = time.monotonic() - t0
        assert (grace_s <= took < grace_s + 2) if signals == 1 else took < 2, took
        assert root.stdout.read() == f"overdue {int(signal.SIGTERM)} 1\n"
        assert not still_alive_after([child], 1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)
