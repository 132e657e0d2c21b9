"""structlog setup shared by every process: JSON lines to a file, readable lines on the console.

Every line carries `role`, `actor_id` and `policy_version` from one process-wide
context (not contextvars: the learner's hub thread and training thread share it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog

_CONTEXT: dict[str, Any] = {"role": "?", "actor_id": None, "policy_version": None}


def set_context(**values: Any) -> None:
    _CONTEXT.update(values)


def _add_context(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _CONTEXT.items():
        event.setdefault(key, value)
    return event


class _JsonTee:
    """Processor: write the event as one JSON line to a file, pass it on to the console renderer."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        self.file.write(json.dumps(event, default=str) + "\n")
        return event


def setup_logging(role: str, log_file: Path | None = None, level: int = logging.DEBUG if os.environ.get("FLEETRL_DEBUG") else logging.INFO, **context: Any):
    set_context(role=role, **context)
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_context,
        structlog.processors.format_exc_info,
    ]
    if log_file is not None:
        processors.append(_JsonTee(log_file))
    processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger()


def get_logger():
    return structlog.get_logger()


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
