"""The demo launcher's supervision (deploy/launch.py): a signal to the launcher stops every process it started.

The children run in sessions of their own, so before `supervise` a SIGTERM to the launcher (kill, a job
scheduler, `timeout`) killed it alone and left the learner training and the actors waiting forever.
Real processes here: a launcher process, its children, and a grandchild in each child's group (as vLLM's
engine core is in an actor's).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A child that exits a little after SIGTERM, as the learner and actors do, and leaves a grandchild in its group.
CHILD = (
    "import signal, subprocess, sys, time; "
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.2), sys.exit(0))); time.sleep(600)"
)

# Default dispositions first: a test run started in the background inherits SIGINT ignored, and under
# nohup SIGHUP, and the launcher leaves an ignored signal ignored (test_nohup_keeps_sighup_ignored).
DRIVER = f"""
import pathlib, signal, subprocess, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
if len(sys.argv) > 2:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
from deploy.launch import Supervisor, supervise
sup = Supervisor()
def start():
    for name in ("learner", "actor0"):
        sup.start(name, [sys.executable, "-c", {CHILD!r}])
    tmp = pathlib.Path(sys.argv[1] + ".tmp")
    tmp.write_text(" ".join(str(p.pid) for p in sup.procs.values()))
    tmp.rename(sys.argv[1])
sys.exit(supervise(sup, start, "learner"))
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie nobody reaped yet counts as gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def wait_for(what, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def start_launcher(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    pids = tmp_path / "children"
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(pids), *extra], cwd=ROOT, stdout=subprocess.DEVNULL), pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_all_it_started(sig, tmp_path):
    launcher, pids = start_launcher(tmp_path)
    children: list[int] = []
    grandchildren: list[int] = []
    try:
        assert wait_for(lambda: pids.exists() and pids.read_text()), "the launcher did not start its children"
        children = [int(p) for p in pids.read_text().split()]
        grandchildren = wait_for(lambda: g if len(g := [c for p in children for c in children_of(p)]) == 2 else [])
        assert len(children) == 2 and len(grandchildren) == 2, (children, grandchildren)
        assert all(alive(p) for p in children + grandchildren)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == 128 + sig
        assert wait_for(lambda: not any(alive(p) for p in children + grandchildren), 5.0), (
            f"left running after the launcher stopped: {[p for p in children + grandchildren if alive(p)]}"
        )
    finally:
        launcher.kill()
        launcher.wait()
        for pid in children + grandchildren:  # a failed run must not leave them behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_nohup_keeps_sighup_ignored(tmp_path):
    """Under nohup, closing the terminal must not stop the run: SIGHUP stays ignored; SIGTERM still stops it."""
    launcher, pids = start_launcher(tmp_path, "nohup")
    children: list[int] = []
    try:
        assert wait_for(lambda: pids.exists()), "the launcher did not start its children"
        children = [int(p) for p in pids.read_text().split()]
        launcher.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert launcher.poll() is None and all(alive(p) for p in children)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
        launcher.wait()
        for pid in children:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
