"""Long phases (engine start, checkpoint save, weight broadcast) log begin, "still" while they last, and done."""

import logging
import math
import time

import pytest
import structlog
from structlog.testing import capture_logs

from protocol.progress import phase


@pytest.fixture
def debug_level():
    """Let debug lines through even if an earlier in-process setup_logging filtered at INFO."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    yield
    structlog.configure(wrapper_class=old)


def test_long_phase_reports_progress(debug_level):
    with capture_logs() as logs:
        with phase(structlog.get_logger(), "checkpoint.save", every_s=0.1, path="/x"):
            # Blocks until the ticker has spoken three times (not a sleep that hopes it did), 30 s at most.
            deadline = time.monotonic() + 30
            while sum(e["event"] == "checkpoint.save.still" for e in logs) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # polls the condition
        with pytest.raises(OSError), phase(structlog.get_logger(), "checkpoint.save", every_s=5.0, path="/y"):
            raise OSError("disk full")
        with phase(structlog.get_logger(), "weights.broadcast", every_s=5.0, quiet=True):
            pass
        with pytest.raises(RuntimeError), phase(structlog.get_logger(), "weights.broadcast", every_s=5.0, quiet=True):
            raise RuntimeError("aborted")
    events = [(e["event"], e["log_level"]) for e in logs]
    still = [e for e in logs if e["event"] == "checkpoint.save.still"]
    assert events[0] == ("checkpoint.save.begin", "info") and len(still) >= 3
    assert [e["waited_s"] for e in still] == sorted(e["waited_s"] for e in still) and still[0]["path"] == "/x"
    done = next(e for e in logs if e["event"] == "checkpoint.save.done")
    assert done["duration_s"] >= still[2]["waited_s"] >= 0.3 and math.isfinite(done["duration_s"])
    failed = next(e for e in logs if e["event"] == "checkpoint.save.failed")
    assert failed["path"] == "/y" and "disk full" in failed["error"]
    # a quiet phase that was quick says so only at debug level
    assert ("weights.broadcast.begin", "debug") in events and ("weights.broadcast.done", "debug") in events
    assert ("weights.broadcast.failed", "debug") in events  # its caller says why, in its own line
