"""A learner and actors as separate processes, each started (and killed) on its own, their JSON logs read back.

For the elastic tests (tests/integration/test_elastic.py) and the attach, stall and scaling benchmarks: the same
commands an operator runs (`fleetrl learner`, `fleetrl actor --learner ...`), one process group each,
so a SIGKILL takes an actor's vLLM engine processes with it, as a lost machine would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from deploy import procs
from protocol.config import dump_toml, load_config
from protocol.net import free_port

ROOT = Path(__file__).resolve().parent.parent
Event = dict[str, Any]


class Fleet:
    def __init__(self, run_dir: Path, model_path: str | Path, overrides: list[str]):
        self.run_dir = Path(run_dir).absolute()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.cfg = load_config(None, [f"run.dir={self.run_dir}", f"model.path={model_path}", f"hub.bind={self.addr}", *overrides])
        self.config = self.run_dir / "fleet.toml"
        self.config.write_text(dump_toml(self.cfg))
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}  # time.time() at Popen
        self._logs: dict[str, list[Event]] = {}
        self._offsets: dict[str, int] = {}

    # ---- processes -------------------------------------------------------------------------------
    def _start(self, name: str, argv: list[str], env: dict[str, str] | None, cpus: str) -> subprocess.Popen:
        full = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), **(env or {})}
        log = self.run_dir / f"{name}.out"
        log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "deploy.cli", *argv, "--config", str(self.config)]
        if cpus:
            cmd.append(f"{'train' if name == 'learner' else 'actor'}.cpu_affinity={cpus}")
        self.started[name] = time.time()
        proc = procs.spawn(cmd, full, log, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def start_learner(self, env: dict[str, str] | None = None, cpus: str = "", resume: bool = False) -> subprocess.Popen:
        """`resume`: `fleetrl learner --resume RUN_DIR`, from the run's last checkpoint."""
        return self._start("learner", ["learner", *(["--resume", str(self.run_dir)] if resume else [])], env, cpus)

    def start_actor(self, actor_id: str, env: dict[str, str] | None = None, cpus: str = "") -> subprocess.Popen:
        return self._start(actor_id, ["actor", "--learner", self.addr, "--id", actor_id], env, cpus)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Signal the whole process group (the actor and its engine processes); returns time.time() of the kill."""
        t = time.time()
        procs.signal_group(self.procs[name], sig)
        return t

    def wait_exit(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def stop_all(self) -> None:
        procs.stop(self.procs.values())

    def output(self, name: str) -> str:
        return (self.run_dir / f"{name}.out").read_text(errors="replace")

    # ---- logs ------------------------------------------------------------------------------------
    def log(self, name: str) -> list[Event]:
        """Every JSON line `name` has logged so far (learner -> logs/learner.jsonl, actor X -> logs/actor-X.jsonl)."""
        path = self.run_dir / "logs" / ("learner.jsonl" if name == "learner" else f"actor-{name}.jsonl")
        events = self._logs.setdefault(name, [])
        if path.exists():
            offset = self._offsets.get(name, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
            events.extend(json.loads(line) for line in data[:end].splitlines())
            self._offsets[name] = offset + end
        return events

    def find(self, name: str, event: str, pred: Callable[[Event], bool] = lambda e: True) -> list[Event]:
        return [e for e in self.log(name) if e["event"] == event and pred(e)]

    def wait_for(
        self,
        name: str,
        event: str,
        pred: Callable[[Event], bool] = lambda e: True,
        timeout: float = 120.0,
        after: int = 0,
        poll_s: float = 0.005,
    ) -> Event:
        """The first `event` logged by `name` (from its `after`-th line on) matching `pred`; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.log(name)[after:]:
                if e["event"] == event and pred(e):
                    return e
            for proc_name, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"{proc_name} exited with {p.returncode}:\n{self.output(proc_name)[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: no {event} within {timeout} s")
            time.sleep(poll_s)

    def metrics(self) -> list[Event]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def exit_on_sigterm() -> None:
    """A benchmark stopped by SIGTERM unwinds (its `finally: fleet.stop_all()` runs) instead of leaving its fleet behind."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def when(event: Event) -> float:
    """An event's timestamp as time.time() seconds (structlog writes ISO 8601 UTC)."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()
