"""What a sandboxed run returns, and how its ending is named (`classify`: plain data in, a reason out)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Literal

Reason = Literal["ok", "exit", "timeout", "cpu", "memory", "file_size", "processes", "output", "killed", "sandbox"]
# ok:        exit status 0
# exit:      a non-zero exit status (an exception, a failed assert, sys.exit(1))
# timeout:   still running after wall_s: every process of the run was killed
# cpu:       a process used its cpu_s (SIGXCPU, or SIGKILL at the hard limit)
# memory:    an allocation failed at memory_bytes (the program died of MemoryError)
# file_size: a write failed at file_bytes (EFBIG, or SIGXFSZ for a program that does not ignore it)
# processes: a fork failed at the process limit (EAGAIN) and the program died of it
# output:    stdout or stderr went past output_bytes: every process of the run was killed
# killed:    the main process died of another signal (it killed itself, a segfault)
# sandbox:   the sandbox itself failed (could not start the run); `error` says why. Not the code's fault.


@dataclass(frozen=True, slots=True)
class SandboxResult:
    reason: Reason
    returncode: int | None  # the main process's exit status; -N when signal N ended it; None when it never ran
    stdout: bytes  # at most limits.output_bytes
    stderr: bytes  # at most limits.output_bytes
    wall_s: float  # from the start of the run to its end, cleanup included
    cpu_s: float  # CPU seconds (user + system) of the main process and the children it waited for
    error: str = ""  # one line: why the sandbox failed (reason "sandbox"), else ""

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


# The last line of a Python traceback that names the failure; only the code under test writes stderr, so a program
# can only mislabel its own run with it.
_MEMORY = re.compile(rb"^(?:[\w.]+\.)?\w*MemoryError\b", re.MULTILINE)
_FILE_SIZE = re.compile(rb"\[Errno 27\] File too large")
_FORK = re.compile(rb"^BlockingIOError: \[Errno 11\]", re.MULTILINE)


def classify(*, returncode: int, timed_out: bool, output_exceeded: bool, stderr: bytes, cpu_s: float, cpu_limit_s: float) -> Reason:
    """The reason a run ended, from what the supervisor and the pipes saw (the first that applies, in this order)."""
    if output_exceeded:
        return "output"
    if timed_out:
        return "timeout"
    if returncode < 0:
        sig = -returncode
        # The kernel sends SIGKILL at the hard CPU limit (soft + 1 s) to a process that survived SIGXCPU.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cpu_limit_s):
            return "cpu"
        if sig == signal.SIGXFSZ:
            return "file_size"
        return "killed"
    if returncode == 0:
        return "ok"
    tail = stderr[-2048:]
    if _MEMORY.search(tail):
        return "memory"
    if _FILE_SIZE.search(tail):
        return "file_size"
    if _FORK.search(tail):
        return "processes"
    return "exit"
