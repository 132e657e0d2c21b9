"""A sandbox for code that tools and rewards execute: one subprocess per run, limited, then removed.

    from actors.sandbox import SandboxLimits, run
    result = await run("print(input()[::-1])", stdin="abc", limits=SandboxLimits(wall_s=2))
    result.reason, result.stdout     # "ok", b"cba\\n"

Each run gets a temporary directory (its cwd, HOME and TMPDIR, removed afterwards), a minimal environment
(nothing of the caller's), and limits (SandboxLimits): wall time, CPU time, address space, processes, open
files, file size, output size. How it ended is a typed reason (SandboxResult.reason); the code's failures
never raise. The supervisor process between the caller and the code kills and reaps everything the code
started, daemons included (actors/sandbox/supervisor.py).

What is isolated, started as root: the code runs as a uid of its own (one per concurrent run), so it cannot
signal the caller or any other process, nor read or write files that others cannot (the repository, the
caller's home, its neighbours' run directories); the process limit holds; and it runs in a new network
namespace with no interface up, so it reaches no network, loopback included.

What is not: there is no filesystem jail. The code sees the whole filesystem as any other user sees it, reads
what is world-readable, and may write the world-writable directories (/tmp, /var/tmp, /dev/shm; each file at
most file_bytes, and its files there are removed after the run). It shares the kernel, the CPU and the page cache
with the caller; the memory limit is per process (RLIMIT_AS), not for the whole run. There is no seccomp filter.

Started without root, it is a resource limiter, not a security boundary: the code runs as the caller's
user, so it can signal the caller (os.kill(os.getppid(), 9) kills the supervisor; the caller's pid is one
lookup away), read and write whatever the caller can, and use the network; the process limit is not set,
since it would count the caller's own processes.
"""

from actors.sandbox.limits import SandboxLimits
from actors.sandbox.result import Reason, SandboxResult
from actors.sandbox.runner import SandboxError, run, run_sync

__all__ = ["Reason", "SandboxError", "SandboxLimits", "SandboxResult", "run", "run_sync"]
