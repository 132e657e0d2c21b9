"""What one sandboxed run may use: each field is one limit, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock seconds before the run's processes are killed (reason "timeout")
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later (reason "cpu")
    # Address space per process (RLIMIT_AS), not resident memory: an allocation past it fails (MemoryError in Python).
    # Python alone maps about 20 MiB; thread stacks and imported C libraries map more, so leave room.
    memory_bytes: int = 1 << 30
    processes: int = 32  # processes and threads of the run's uid at once (RLIMIT_NPROC); enforced only when started as root
    open_files: int = 64  # file descriptors per process (RLIMIT_NOFILE)
    file_bytes: int = 16 << 20  # the largest file a process may write (RLIMIT_FSIZE): a write past it fails with EFBIG
    output_bytes: int = 1 << 20  # stdout and stderr are each read up to this; one more byte kills the run (reason "output")
    network: bool = False  # False: run in a new, empty network namespace (root only; without root the network is open)
    python: str = ""  # the interpreter that runs the code; "" = this one, or a system python3 the sandbox uid can run

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "processes", "open_files", "file_bytes", "output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"SandboxLimits.{name}: {value!r} must be a number > 0")
        for name in ("cpu_s", "memory_bytes", "processes", "open_files", "file_bytes", "output_bytes"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"SandboxLimits.{name}: {getattr(self, name)!r} must be an int")
