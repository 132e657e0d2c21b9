"""The code sandbox (actors/sandbox) against hostile code: each case stays within its limit, ends with its typed
reason, leaves no process behind, and the caller still runs a normal program afterwards. The cases that rely on
root (a uid per run: the process limit, file permissions, signals; a network namespace) skip without it.

Each test was checked against its protection removed (docs/multi-turn.md#sandbox): it then fails."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until

from actors.sandbox import SandboxLimits, SandboxResult, run, workspace
from actors.sandbox.workspace import SLOTS, UID_BASE, slot_locks

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1, memory_bytes=256 << 20, processes=16, file_bytes=8 << 20, output_bytes=64 << 10)
GUARD_S = 15.0  # the test's own bound on a run: without the sandbox's, a hostile run would hang the test
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a uid per run and a network namespace")


def sandboxed(code: str, limits: SandboxLimits = LIMITS, stdin: str = "") -> tuple[SandboxResult, float]:
    async def main() -> SandboxResult:
        return await asyncio.wait_for(run(code, stdin, limits), GUARD_S)

    start = time.monotonic()
    result = asyncio.run(main())
    return result, time.monotonic() - start


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _slot_held(uid: int) -> bool:
    """Whether a run holds `uid`'s slot now (its lock taken), in any process of this machine."""
    try:
        fd = os.open(slot_locks() / str(uid - UID_BASE), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False  # closing the file drops the lock at once
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def sandbox_processes() -> list[int]:
    """Processes of a sandbox uid whose slot no run holds: what a run left behind. A run still going, in another
    process (make test's other worker runs test_code_reward's sandboxes), holds its slot while its processes live;
    one that ended between the scan and the lock check has none left, hence the second look at each process."""
    return [pid for pid, uid in workspace.sandbox_processes().items() if not _slot_held(uid) and _owner(pid) == uid]


def assert_unharmed() -> None:
    """Nothing of the run is left, and this process still runs a normal program."""
    assert sandbox_processes() == []
    result, _ = sandboxed("print(sum(range(10)))")
    assert (result.reason, result.stdout) == ("ok", b"45\n")


def test_normal_program_reads_stdin_and_exits():
    result, _ = sandboxed("import sys\nprint(sys.stdin.read()[::-1])\nsys.exit(3)", stdin="abc")
    assert (result.reason, result.returncode, result.stdout) == ("exit", 3, b"cba\n")


def test_infinite_loop_ends_at_the_wall_time():
    result, elapsed = sandboxed("while True:\n    pass", SandboxLimits(wall_s=1.0, cpu_s=30))
    assert result.reason == "timeout"
    assert 1.0 <= elapsed < 5.0  # the CPU limit (30 s) is far off
    assert_unharmed()


def test_busy_loop_ends_at_the_cpu_limit():
    result, elapsed = sandboxed("while True:\n    pass", SandboxLimits(wall_s=10.0, cpu_s=1))
    assert result.reason == "cpu"
    assert result.cpu_s >= 0.9 and elapsed < 8.0  # the kernel counts CPU time in ticks
    assert_unharmed()


@needs_root
def test_fork_bomb_is_held_to_the_process_limit():
    """Every fork that succeeds writes one byte: no process ever exits, so the bytes count processes alive at once."""
    code = (
        "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.write(1, b'+')\n    except OSError:\n        pass\n"
    )
    result, elapsed = sandboxed(code, SandboxLimits(wall_s=2.0, cpu_s=30, processes=16))
    assert result.reason == "timeout"
    assert 0 < result.stdout.count(b"+") < 16
    assert elapsed < 6.0
    assert_unharmed()


def test_ten_gigabyte_allocation_fails_at_the_memory_limit():
    result, elapsed = sandboxed("x = b'x' * (10 << 30)\nprint(len(x))")
    assert result.reason == "memory"
    assert b"MemoryError" in result.stderr and elapsed < 5.0
    assert_unharmed()


def test_one_gigabyte_write_stops_at_the_file_size_limit():
    code = "f = open('big', 'wb')\nfor _ in range(1024):\n    f.write(b'0' * (1 << 20))\n"
    result, elapsed = sandboxed(code)
    assert result.reason == "file_size"
    assert elapsed < 5.0
    assert_unharmed()


def test_endless_output_is_cut_at_the_output_limit():
    result, elapsed = sandboxed("while True:\n    print('x' * 1000)")
    assert result.reason == "output"
    assert len(result.stdout) == LIMITS.output_bytes and elapsed < 5.0
    assert_unharmed()


@needs_root
def test_writing_outside_its_directory_is_refused(tmp_path):
    """The caller's directory (root's, readable by all, as a run directory is) and the parent of the run's own."""
    tmp_path.chmod(0o755)
    targets = [str(tmp_path / "escape.txt"), "../escape.txt"]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except PermissionError:\n        print('denied', path)\n"
    )
    result, _ = sandboxed(code)
    assert result.reason == "ok"
    assert result.stdout.decode().split("\n")[:2] == [f"denied {t}" for t in targets]
    assert not (tmp_path / "escape.txt").exists()
    assert_unharmed()


@needs_root
def test_socket_to_the_outside_fails():
    """A server of the caller's on loopback: the code's connection must not reach it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n    print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
        )
        result, _ = sandboxed(code)
        assert result.reason == "ok" and result.stdout.startswith(b"refused")
        with pytest.raises(BlockingIOError):
            server.accept()
    assert_unharmed()


KILL_PARENTS = """
import os
parent = os.getppid()
with open(f"/proc/{parent}/stat") as f:
    grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
print(parent, grandparent, flush=True)
for pid in (parent, grandparent):
    try:
        os.kill(pid, 9)
    except PermissionError:
        print("denied", flush=True)
"""

CALLER = """
import os, sys
from actors.sandbox import run_sync
print(os.getpid(), flush=True)
result = run_sync(sys.stdin.read())
print(result.reason, flush=True)
print(result.stdout.decode(), flush=True)
"""


@needs_root
def test_killing_its_parent_leaves_the_caller_alive():
    """The caller is a process of its own here, so that the kill, if it got through, would not end pytest. The
    code's parent is the supervisor; the caller (the actor, in production) is its grandparent: both kills fail."""
    proc = subprocess.run([sys.executable, "-c", CALLER], input=KILL_PARENTS, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert proc.returncode == 0, proc.stderr
    caller, reason, parents, *denied = proc.stdout.split("\n")
    assert reason == "ok"
    assert int(parents.split()[1]) == int(caller)  # the code did target the caller
    assert denied[:2] == ["denied", "denied"]
    assert_unharmed()


def test_cancelled_run_kills_its_processes():
    """An actor drops an episode: cancelling the run stops the code and whatever it started, at once."""

    async def main() -> None:
        task = asyncio.create_task(run("import os, time\nos.fork()\ntime.sleep(60)", limits=SandboxLimits(wall_s=60)))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_unharmed()


@needs_root
def test_daemon_that_left_its_session_is_killed():
    """A double fork into a new session escapes a process-group kill; the supervisor, as subreaper, still reaps it."""
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\nprint('left')\n"
    )
    result, elapsed = sandboxed(code)
    assert (result.reason, result.stdout) == ("ok", b"left\n") and elapsed < 10.0  # not the daemon's 60 s
    assert_unharmed()


@needs_root
def test_the_leftover_scan_tells_a_run_in_progress_from_a_leftover():
    """assert_unharmed's scan: a process of a sandbox uid is a leftover unless a run holds that uid's slot (another
    process's run, on make test's other worker)."""
    uid = UID_BASE + SLOTS - 1
    slot_locks().mkdir(mode=0o700, exist_ok=True)
    stray = subprocess.Popen(["sleep", "30"], user=uid, group=uid)
    try:
        wait_until(lambda: _owner(stray.pid) == uid, f"the child did not drop to uid {uid}", 5.0, every_s=0.01)
        assert stray.pid in sandbox_processes()
        fd = os.open(slot_locks() / str(SLOTS - 1), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run in progress holds it
            assert stray.pid not in sandbox_processes()
        finally:
            os.close(fd)
        assert stray.pid in sandbox_processes()
    finally:
        stray.kill()
        stray.wait()
    assert stray.pid not in sandbox_processes()
