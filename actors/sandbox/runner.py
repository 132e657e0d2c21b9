"""Run code in the sandbox: `await run(code, stdin, limits)` on an event loop, `run_sync` outside one.

    run -> uid slot + run directory (a thread) -> supervisor process (actors/sandbox/supervisor.py)
        -> feed stdin, read stdout/stderr up to output_bytes each (past it: SIGUSR1, the supervisor kills all)
        -> supervisor exits after wall_s at most -> its status line -> SandboxResult -> clear (a thread)

Nothing here blocks the event loop for longer than a few system calls: the process is asyncio's, and the
directory work (mkdtemp, chown, rmtree of what the code wrote) runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

from actors.sandbox import workspace
from actors.sandbox.limits import SandboxLimits
from actors.sandbox.result import SandboxResult, classify
from protocol.logs import current_log_file, first_line, get_logger, log_exception

SUPERVISOR = str(Path(__file__).with_name("supervisor.py"))
BACKSTOP_S = 10.0  # past wall_s + this, the supervisor itself is presumed stuck and SIGKILLed with its groups
READ_CHUNK = 1 << 16
# The code's whole environment: nothing of the caller's (tokens, keys) reaches it. One thread per math library,
# since threads count against the process limit.
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxError(RuntimeError):
    """The sandbox could not run the code (no usable interpreter, no uid slot): not the code's fault."""


async def run(code: str, stdin: str | bytes = b"", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run Python `code` with `stdin`; the result names how it ended. Never raises for what the code does."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    try:
        with workspace.uid_slot() as uid:
            workdir, status = await asyncio.to_thread(workspace.make_workdir, uid)
            try:
                return await _run(code, stdin if isinstance(stdin, bytes) else stdin.encode(), limits, uid, workdir, status, start)
            finally:
                await asyncio.to_thread(workspace.clear, workdir, status, uid)
    except (OSError, SandboxError, RuntimeError) as e:  # the sandbox's own failure: one line here, the traceback in the log
        error = first_line(e)
        get_logger().warning("sandbox.error", error=error)
        if (log := current_log_file()) is not None:
            log_exception(log, "sandbox.error", e)
        return SandboxResult("sandbox", None, b"", b"", time.monotonic() - start, 0.0, error)


def run_sync(code: str, stdin: str | bytes = b"", limits: SandboxLimits | None = None) -> SandboxResult:
    """`run` for a caller without an event loop (a reward function in its worker process)."""
    with contextlib.suppress(RuntimeError):
        asyncio.get_running_loop()
        raise SandboxError("run_sync called on a running event loop: await actors.sandbox.run(...) instead")
    return asyncio.run(run(code, stdin, limits))


async def _run(code: str, stdin: bytes, limits: SandboxLimits, uid: int | None, workdir: Path, status: Path, start: float) -> SandboxResult:
    main = workdir / "main.py"
    main.write_text(code)
    if uid is not None:
        os.chown(main, uid, uid)
    spec = {
        "argv": [interpreter(limits.python, uid is not None), "-E", "-s", "-B", "main.py"],
        "env": {**_ENV, "HOME": str(workdir), "TMPDIR": str(workdir)},
        "uid": uid,
        "rlimits": _rlimits(limits, uid is not None),
        "netns": not limits.network and workspace.is_root(),
        "wall_s": limits.wall_s,
        "parent": os.getpid(),
        "status_path": str(status),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", SUPERVISOR, json.dumps(spec),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=workdir, start_new_session=True,
    )  # fmt: skip
    exceeded = False

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)

    async def read(stream: asyncio.StreamReader) -> bytes:
        nonlocal exceeded
        kept = bytearray()
        while chunk := await stream.read(READ_CHUNK):  # read to EOF, keeping output_bytes at most
            if len(kept) + len(chunk) > limits.output_bytes:
                chunk = chunk[: limits.output_bytes - len(kept)]
                if not exceeded:
                    exceeded = True
                    stop()
            kept += chunk
        return bytes(kept)

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the code need not read its stdin
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()

    assert proc.stdout is not None and proc.stderr is not None
    work = asyncio.gather(read(proc.stdout), read(proc.stderr), feed(), proc.wait())
    try:
        out, err, _, _ = await asyncio.wait_for(asyncio.shield(work), limits.wall_s + BACKSTOP_S)
    except TimeoutError:
        _kill_groups(proc.pid, _status_lines(status))
        await work
        raise SandboxError(f"the supervisor outlived wall_s by {BACKSTOP_S}s and was killed") from None
    except BaseException:  # cancelled: the supervisor kills and reaps the run, then exits
        stop()
        # Wait for it (milliseconds): a subprocess transport left open is closed later by the garbage collector,
        # on a closed loop, which raises inside whatever code the collection interrupted.
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(work), BACKSTOP_S)
        raise
    lines = _status_lines(status)
    errors = [line["error"] for line in lines if "error" in line]
    if errors:
        raise SandboxError(errors[0])
    end = next((line for line in lines if "returncode" in line), None)
    if end is None:
        raise SandboxError(f"the supervisor exited {proc.returncode} without a status")
    reason = classify(
        returncode=end["returncode"],
        timed_out=end["timed_out"],
        output_exceeded=exceeded,
        stderr=err,
        cpu_s=end["cpu_s"],
        cpu_limit_s=limits.cpu_s,
    )
    return SandboxResult(reason, end["returncode"], out, err, time.monotonic() - start, end["cpu_s"])


def _rlimits(limits: SandboxLimits, own_uid: bool) -> list[tuple[str, int, int]]:
    out = [
        ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
        ("RLIMIT_NOFILE", limits.open_files, limits.open_files),
        ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes),
        ("RLIMIT_CORE", 0, 0),
    ]
    if own_uid:  # without a uid of its own the count would include every process of the caller's user
        out.append(("RLIMIT_NPROC", limits.processes, limits.processes))
    return out


def _status_lines(status: Path) -> list[dict]:
    try:
        text = status.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _kill_groups(supervisor: int, lines: list[dict]) -> None:
    for pgid in [supervisor, *(line["started"] for line in lines if "started" in line)]:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


@functools.cache
def interpreter(configured: str, other_uid: bool) -> str:
    """The Python that runs the code: the configured one, else this one, else a system python3 that the run's
    uid can reach (this one may sit under a private home, e.g. /root/.pyenv). Its packages come with it."""
    if configured:
        return configured
    if not other_uid:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.isfile(real) and _others_can(real, stat.S_IXOTH) and _others_can(str(Path(real).parents[1] / "lib"), stat.S_IROTH):
            return real
    raise SandboxError("no Python interpreter the sandbox uid can run: set SandboxLimits.python")


def _others_can(path: str, bit: int) -> bool:
    """Every directory above `path` is searchable by other users, and `path` itself has `bit` for them."""
    p = Path(path)
    try:
        return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents) and bool(os.stat(p).st_mode & bit)
    except OSError:
        return False
