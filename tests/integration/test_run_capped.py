"""A child run under a time limit (deploy/procs.run_capped, which torchrun_driver uses): at the limit the whole process
group dies, grandchildren included, and the test fails with one line naming the driver and the limit."""

import os
import sys
import time

import pytest
from conftest import torchrun_driver

from deploy.procs import run_capped


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for whoever inherited it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_whole_group_dies_at_the_limit():
    t0 = time.monotonic()
    # A grandchild (as torchrun's ranks are), its pid printed before the parent waits on it.
    ran = run_capped(["bash", "-c", "sleep 60 & echo $!; wait"], 1.0)
    assert ran.returncode is None and time.monotonic() - t0 < 15
    pid = int(ran.stdout.split()[0])  # what it wrote before the kill is kept
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), f"grandchild {pid} outlived the limit"


def test_a_run_that_ends_in_time_reports_its_exit_and_output():
    ran = run_capped([sys.executable, "-c", "import sys; print('out'); sys.stderr.write('err'); sys.exit(3)"], 60.0)
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, "out\n", "err")


def test_torchrun_out_of_time_fails_with_one_line(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        # torchrun alone takes longer than this to start its rank: the rank is killed with it.
        torchrun_driver("train_steps.py", 1, tmp_path / "out.json", "no-model", str(tmp_path / "out.json"), timeout=1.0)
    first = str(failed.value).splitlines()[0]
    assert first == "torchrun train_steps.py (1 ranks, cpu): out of time, no result within 1 s", first
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "out.json").exists()


def test_gone_tells_a_live_process_from_a_dead_one():
    assert not _gone(os.getpid())
