"""The supervisor of one sandboxed run: `python -I -S supervisor.py SPEC`, started by actors/sandbox/runner.py.

    supervisor (the runner's uid, a new session; in a new network namespace when asked)
      `-- the code (fork, own process group, rlimits, then setuid to the run's uid, then exec)
            `-- whatever the code starts: orphans come back to the supervisor (a child subreaper)

It waits for the code's main process, wall_s at most, or until the runner asks it to stop (SIGUSR1 or
SIGTERM: the output went past its limit, or the run was cancelled). Then it kills every process still below it
and reaps them all, then appends one JSON line to the status file: the exit status, the CPU time, whether the
wall time ran out. It is the code's parent, so the code's os.kill(os.getppid(), 9) reaches it, not the actor:
under root it keeps root's uid and that kill is refused; without root the kill works and the run ends early.

Reaping matters: the init of a container often reaps nothing, and a zombie still counts against its uid's
process limit. As the subreaper, the supervisor is the parent of every orphan of the run, daemons that called
setsid() included, so it finds them all by walking its own children.

Standard library only, no FleetRL import: it starts with -I -S, so a run costs one interpreter start more.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNET = 0x40000000  # <sched.h>
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
REAP_S = 5.0  # the kill-and-reap loop gives up after this; a process the kernel cannot kill is past saving
STOP = {signal.SIGTERM, signal.SIGUSR1}

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}): {os.strerror(ctypes.get_errno())}")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    status = open(spec["status_path"], "a", buffering=1)  # noqa: SIM115 (open for the life of the process)

    def report(**fields: object) -> None:
        status.write(json.dumps(fields) + "\n")

    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the runner (a reward worker killed for its timeout)
    if os.getppid() != spec["parent"]:
        return 1
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if spec["netns"] and _libc.unshare(CLONE_NEWNET) != 0:
        report(error=f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
        return 1
    waited = {signal.SIGCHLD, *STOP}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # taken with sigtimedwait: no handler races the loop below
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _exec_code(spec, report, supervisor=os.getppid())
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done in the child: whichever runs first, the group exists before any kill
    report(started=pid)

    deadline = start + spec["wall_s"]
    timed_out = stopped = False
    ended: tuple[int, float] | None = None  # (wait status, CPU seconds) of the main process
    while ended is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        info = signal.sigtimedwait(waited, left)
        if info is not None and info.si_signo in STOP:
            stopped = True
            break
        ended = _reap(pid) or ended

    ended = _kill_all(pid) or ended
    assert ended is not None, "the main process was reaped above or in _kill_all"
    report(
        returncode=os.waitstatus_to_exitcode(ended[0]),
        cpu_s=ended[1],
        timed_out=timed_out,
        stopped=stopped,
        wall_s=time.monotonic() - start,
    )
    return 0


def _exec_code(spec: dict, report, supervisor: int) -> None:
    """In the forked child: own process group, limits, the run's uid, then exec. Never returns."""
    try:
        os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a signal mask survives exec
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores both, and an ignored signal survives exec
            signal.signal(sig, signal.SIG_DFL)
        for name, soft, hard in spec["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if os.getppid() != supervisor:
            os._exit(1)
        os.umask(0o077)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:  # the exec failed: the runner reports it as the sandbox's error
        report(error=f"starting the code: {type(e).__name__}: {e}")
    os._exit(127)


def _reap(main_pid: int) -> tuple[int, float] | None:
    """Reap every child that has exited; the main process's (status, CPU seconds) if it was one of them."""
    found = None
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == main_pid:
            found = (status, usage.ru_utime + usage.ru_stime)


def _kill_all(main_pid: int) -> tuple[int, float] | None:
    """SIGKILL the code's process group, then every child (orphans included) until none is left; reap them all."""
    found = None
    with contextlib.suppress(OSError):
        os.killpg(main_pid, signal.SIGKILL)
    end = time.monotonic() + REAP_S
    while time.monotonic() < end:
        children = _children()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        found = _reap(main_pid) or found
        if not children:
            try:  # none listed: done once none is left unreaped either (WNOWAIT: the main one's status stays)
                os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
        time.sleep(0.001)
    return found


def _children() -> list[int]:
    """This process's children (the supervisor has one thread: its task's children are all of them)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: scan /proc
        pass
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
