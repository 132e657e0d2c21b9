"""Local launcher: one learner and N actors as separate processes on this machine (`fleetrl demo`).

Each child runs in its own process group (an actor owns vLLM's engine-core and
worker processes), so stopping a child stops everything it started. If any child
fails, all are stopped and the launcher exits non-zero. Ctrl-C, SIGTERM (`kill`, a job
scheduler, `timeout`) and SIGHUP (the terminal closed) stop all cleanly too: the children
live in sessions of their own, so no signal to the launcher reaches them by itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from deploy import procs
from deploy.procs import GRACE_S
from protocol.config import Config, dump_toml
from protocol.logs import get_logger


def connect_address(bind: str) -> str:
    """The address a local actor dials for a hub bound at `bind` (wildcards become loopback)."""
    host_port = bind.removeprefix("tcp://")
    host, _, port = host_port.rpartition(":")
    if host in ("*", "0.0.0.0", ""):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def demo_model(cfg: Config) -> Path:
    """Build (once, cached) the tiny model with its warm start; returns its folder."""
    from deploy.tiny import TOOL_TAGS, write_tiny_model
    from learner.warmstart import warm_start, warm_start_tools

    d = cfg.demo
    tools = d.tool_share > 0  # the tool demo: the calculator's tags in the vocabulary, sums of data.digits digits
    key = json.dumps({"v": 2, "seed": cfg.run.seed, "steps": d.warmstart_steps, "smoothing": d.warmstart_smoothing})
    if tools:
        key = json.dumps(
            {
                "v": 4,
                "seed": cfg.run.seed,
                "steps": d.warmstart_steps,
                "smoothing": d.warmstart_smoothing,
                "tool_share": d.tool_share,
                "digits": cfg.data.digits,
            }
        )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(os.environ.get("FLEETRL_CACHE", Path.home() / ".cache" / "fleetrl"))
    final = root / f"demo-model-{digest}"
    if (final / "config.json").exists():
        return final.absolute()
    log = get_logger()
    log.info("demo.building_model", path=str(final), warmstart_steps=cfg.demo.warmstart_steps)
    tmp = root / f".building-{digest}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    write_tiny_model(tmp, seed=cfg.run.seed, tags=TOOL_TAGS if tools else None)
    if tools:
        info = warm_start_tools(tmp, d.warmstart_steps, cfg.run.seed, d.warmstart_smoothing, cfg.data.digits, d.tool_share)
    else:
        info = warm_start(tmp, d.warmstart_steps, cfg.run.seed, d.warmstart_smoothing)
    try:
        tmp.rename(final)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("demo.model_ready", seconds=round(time.perf_counter() - t0, 1), **info)
    return final.absolute()


def preflight(cfg: Config) -> None:
    """What `fleetrl check` verifies, less the reward's sample score: a wrong model folder, data file or reward is one
    line here (ConfigError), not a learner and N actors failing one after another with their engines half started."""
    import structlog

    from deploy.check import check_data, check_model, check_reward_import

    previous = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # the learner says it again
    try:
        check_data(cfg, check_model(cfg).tokenizer)
        check_reward_import(cfg)
    finally:
        structlog.configure(wrapper_class=previous)


class Supervisor:
    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}
        self.log = get_logger()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.procs[name] = procs.spawn(argv, env)
        self.log.info("launch.started", process=name, pid=self.procs[name].pid)

    def stop_all(self, grace_s: float = GRACE_S) -> None:
        procs.stop(self.procs.values(), grace_s)

    def wait(self, main: str) -> int:
        """Until `main` exits 0 (then the rest get GRACE_S to follow) or anything fails."""
        while True:
            for name, p in self.procs.items():
                code = p.poll()
                if code is None:
                    continue
                if code != 0:
                    self.log.error("launch.process_failed", process=name, exit_code=code)
                    self.stop_all()
                    return 1
                if name == main:
                    self.stop_all()
                    return 0
            time.sleep(0.5)


class Stopped(Exception):
    """Ctrl-C, SIGTERM or SIGHUP reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_stopped(signum: int, frame: object) -> None:
    for s in STOPS:  # the stop that follows must not be cut short by a second signal (it ends in SIGKILL anyway)
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


def supervise(sup: Supervisor, start: Callable[[], None], main: str) -> int:
    """Run `start` (it starts the processes), then `sup.wait(main)`. Ctrl-C, SIGTERM or SIGHUP stops every
    process started so far and returns 128 + the signal number, as a shell reports a death by that signal.
    A signal the launcher was started ignoring (`nohup` ignores SIGHUP) stays ignored."""
    previous = {s: signal.getsignal(s) for s in STOPS}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _raise_stopped)
    try:
        start()
        return sup.wait(main)
    except Stopped as e:
        sup.log.warning("launch.interrupted", signal=signal.Signals(e.signum).name)
        sup.stop_all()
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_demo(cfg: Config) -> int:
    run_dir = Path(cfg.run.dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        cfg.model.path = str(demo_model(cfg))
    preflight(cfg)
    cfg.run.dir = str(run_dir)
    config_file = run_dir / "config.toml"
    config_file.write_text(dump_toml(cfg))
    cli = [sys.executable, "-m", "deploy.cli"]
    sup = Supervisor()

    def start() -> None:
        sup.start("learner", [*cli, "learner", "--config", str(config_file)])
        for i in range(cfg.demo.num_actors):
            sup.start(
                f"actor{i}",
                [*cli, "actor", "--learner", connect_address(cfg.hub.bind), "--config", str(config_file), "--id", f"actor{i}"],
                env={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")},
            )

    code = supervise(sup, start, "learner")
    if code >= 128:  # stopped by a signal: the run is cut short, no summary
        return code
    summarize(run_dir)
    return code


def summarize(run_dir: Path) -> None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    n = max(1, len(rows) // 5)
    first = sum(r["reward_mean"] for r in rows[:n]) / n
    last = sum(r["reward_mean"] for r in rows[-n:]) / n
    print(
        f"\nFleetRL demo: {len(rows)} steps in {rows[-1]['wall_s']:.0f} s of training; "
        f"mean reward {first:.3f} (first {n} steps) -> {last:.3f} (last {n}); run directory {run_dir}",
        flush=True,
    )
