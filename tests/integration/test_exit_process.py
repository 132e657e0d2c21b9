"""learner.train.distributed.exit_process: how a learner rank's process ends after a clean finish. The exit
handlers run (the process groups are destroyed there) and the streams are flushed, then the process exits with
its code, skipping the interpreter's teardown, where gloo sometimes aborted a finished rank (SIGABRT). That abort
is rare and cannot be provoked on demand; this shows the exit keeps what a normal one does."""

import subprocess
import sys

from conftest import ROOT

SCRIPT = """
import atexit, sys, threading, time
import torch.distributed as dist
from learner.train.distributed import exit_process, init_distributed

def note(when):
    with open(sys.argv[1], "a") as f:
        f.write(f"{when}: groups {dist.is_initialized()}\\n")

atexit.register(note, "last")  # registered before init_distributed's handler: runs after it
init_distributed()
atexit.register(note, "first")
if sys.argv[2] == "thread":
    threading.Thread(target=time.sleep, args=(0.5,)).start()  # not a daemon: Python's exit waits for it
sys.stdout.write("unflushed")
exit_process(3)
sys.stdout.write(" returned")
sys.exit(0)
"""


def run(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, str]:
    marker = tmp_path / f"atexit-{mode}"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, marker.read_text() if marker.exists() else ""


def test_a_finished_rank_exits_with_its_code_after_its_exit_handlers(tmp_path):
    proc, marker = run(tmp_path, "plain")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.endswith("unflushed")  # flushed before the exit, and nothing ran after it
    assert marker == "first: groups True\nlast: groups False\n"  # every handler ran; init_distributed's destroyed the group


def test_a_thread_still_running_gets_the_normal_exit(tmp_path):
    proc, marker = run(tmp_path, "thread")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.endswith("unflushed returned") and marker == "first: groups True\nlast: groups False\n"
