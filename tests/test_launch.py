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

ROOT = Path(__file__).resolve().parents[1]

# A child that exits a little after SIGTERM, as the learner and actors do, and leaves a grandchild in its group.
CHILD = ("import signal, subprocess, sys, time; "
         "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('grandchild', g.pid, flush=True); "
         "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.2), sys.exit(0))); time.sleep(600)")

DRIVER = f"""
import subprocess, sys
from deploy.launch import Supervisor, supervise
sup = Supervisor()
def start():
    for name in ("learner", "actor0"):
        sup.start(name, [sys.executable, "-c", {CHILD!r}])
    print("children", *(p.pid for p in sup.procs.values()), flush=True)
sys.exit(supervise(sup, start, "learner"))
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie nobody reaped yet counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_all_it_started(sig):
    launcher = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    grandchildren: list[int] = []
    try:
        while len(children) < 2 or len(grandchildren) < 2:  # on the launcher's stdout, between its log lines
            words = launcher.stdout.readline().split()
            assert words, "the launcher ended before its children started"
            if words[0] == "children":
                children = [int(w) for w in words[1:]]
            elif words[0] == "grandchild":
                grandchildren.append(int(words[1]))
        assert all(alive(p) for p in children + grandchildren)
        time.sleep(0.3)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == 128 + sig
        deadline = time.monotonic() + 5
        while any(alive(p) for p in children + grandchildren) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children + grandchildren if alive(p)], "processes left running after the launcher stopped"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in children + grandchildren:  # a failed run must not leave them behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
