"""structlog setup shared by every process: JSON lines to a file, readable lines on the console.

Every line carries `role`, `actor_id` and `policy_version` from one process-wide
context (not contextvars: the learner's hub thread and training thread share it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import structlog

_CONTEXT: dict[str, Any] = {"role": "?", "actor_id": None, "policy_version": None}
_LOG_FILE: list[Path] = []  # the JSON log file of the last setup_logging, if it had one


def set_context(**values: Any) -> None:
    _CONTEXT.update(values)


def _add_context(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _CONTEXT.items():
        event.setdefault(key, value)
    return event


def first_line(e: BaseException) -> str:
    """ "Type: the message's first line": what a one-line report of an error shows (the traceback goes to the log)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def format_duration(seconds: float) -> str:
    """42s, 3m05s, 2h03m: short enough for a progress line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _console_progress(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """Console only (after the JSON file got the numbers): `step=5 steps_total=100 eta_s=83` reads `step=5/100 eta=1m23s`."""
    if "steps_total" not in event and "eta_s" not in event:
        return event
    head: dict[str, Any] = {}
    if "steps_total" in event:
        head["step"] = f"{event.pop('step', '?')}/{event.pop('steps_total')}"
    if "eta_s" in event:
        eta = event.pop("eta_s")
        head["eta"] = "?" if eta is None else format_duration(eta)
    return {**head, **event}  # the renderer puts timestamp, level and event first in any case


class _JsonTee:
    """Processor: write the event as one JSON line to a file, pass it on to the console renderer."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        self.file.write(json.dumps(event, default=str) + "\n")
        return event


def _stderr_logger(*_args: Any) -> structlog.PrintLogger:
    """sys.stderr as it is when a line is logged, not as it was at setup (a test's captured stream, since closed)."""
    return structlog.PrintLogger(sys.stderr)


# Deprecation notices torch prints when DeepSpeed (ZeRO-3's all_gather_into_tensor, reduce_scatter_tensor) and vLLM
# (torch.distributed.reduce_op, in its engine core) call its old names: nothing a user can act on.
_OLD_NAMES = ("reduce_op", "all_gather_into_tensor", "reduce_scatter_tensor")
_NOT_FOR_USERS = tuple(f"`torch.distributed.{name}` is deprecated" for name in _OLD_NAMES)


def _quiet_notices() -> None:
    """Keep _NOT_FOR_USERS off the screen, in this process and (PYTHONWARNINGS) in the ones it starts: vLLM's CPU
    build spawns its engine core, a fresh interpreter that knows nothing of this one's filters."""
    for message in _NOT_FOR_USERS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=FutureWarning)
    have = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    wanted = [f"ignore:{message}:FutureWarning" for message in _NOT_FOR_USERS]
    os.environ["PYTHONWARNINGS"] = ",".join(have + [e for e in wanted if e not in have])


def setup_logging(
    role: str, log_file: Path | None = None, level: int = logging.DEBUG if os.environ.get("FLEETRL_DEBUG") else logging.INFO, **context: Any
):
    _quiet_notices()
    set_context(role=role, **context)
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_context,
        structlog.processors.format_exc_info,
    ]
    _LOG_FILE.clear()
    if log_file is not None:
        processors.append(_JsonTee(log_file))
        _LOG_FILE.append(Path(log_file))
    processors.append(_console_progress)
    # Fields in the order the call gives them (the context keys come last): a step line starts with its step.
    processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), sort_keys=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger()


def get_logger():
    return structlog.get_logger()


def learner_log_file(run_dir: Path, rank: int) -> Path:
    """Each learner rank's JSON log: rank 0's is learner.jsonl."""
    return run_dir / "logs" / ("learner.jsonl" if rank == 0 else f"learner-rank{rank}.jsonl")


def current_log_file() -> Path | None:
    """The JSON log file this process writes (the last setup_logging's), or None."""
    return _LOG_FILE[0] if _LOG_FILE else None


def log_exception(path: Path, event: str, error: BaseException, **fields: Any) -> None:
    """One JSON line with the traceback, written to `path` only: the console gets its own one-line summary."""
    import traceback

    record = {
        "event": event,
        "level": "error",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **{k: v for k, v in _CONTEXT.items()},
        **fields,
        "error": f"{type(error).__name__}: {error}",
        "exception": "".join(traceback.format_exception(error)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


class Throttle:
    """At most one log line per `period_s` for a noisy event: a flood of bad input must not become a flood of
    log lines (each costs a JSON encode and a write on the thread that should be serving honest peers)."""

    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self._last = float("-inf")
        self._suppressed = 0

    def ready(self) -> int | None:
        """None: stay quiet. Else log now, and report the returned count of lines suppressed since the last."""
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._suppressed += 1
            return None
        suppressed, self._suppressed, self._last = self._suppressed, 0, now
        return suppressed
