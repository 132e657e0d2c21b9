"""`fleetrl`: the command line. One process, one entry point; the launcher composes them.

    fleetrl learner --config FILE [section.field=value ...]
    fleetrl learner --resume RUN_DIR [--config FILE] [section.field=value ...]   continue from RUN_DIR's last checkpoint
    fleetrl actor   --learner tcp://HOST:PORT --config FILE [--id NAME] [section.field=value ...]
    fleetrl demo    [--config FILE] [section.field=value ...]
    fleetrl plan    [--config] FILE [--check] [section.field=value ...]   placement, batch arithmetic, run length, memory
    fleetrl check   [--config] FILE [section.field=value ...]   model, tokenizer, data and reward load; starts nothing
    fleetrl config  --list [PREFIX]                      every config field with its default and doc (TOML)
    fleetrl config  [--config] FILE [section.field=value ...]   the resolved config (TOML)
    fleetrl ctl     --learner tcp://HOST:PORT set max_staleness K     change a running learner's setting
    fleetrl status  --learner tcp://HOST:PORT [--once]                  live view of the learner and its actors
                    (both: --server-key F --client-key F for a hub with CURVE on)
    fleetrl keys    --out DIR [--client NAME ...]          CURVE keys: the learner's pair, one pair per client
    fleetrl --version

A mistake of the user's is one line naming the field and the fix, exit 2; its traceback goes to the log file
(deploy/errors.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from actors import lifeline
from deploy.errors import UsageError, report
from protocol.config import Config, ConfigError, load_config, tcp_port
from protocol.logs import current_log_file, learner_log_file

# A process that an actor starts through multiprocessing (vLLM's engine core and workers) runs this module first,
# as its parent's main module: from here on it dies with the actor (actors/lifeline.py). Anywhere else: nothing.
lifeline.attach()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    from protocol.messages import PROTOCOL_VERSION

    try:
        number = package_version("fleetrl")
    except PackageNotFoundError:  # run from a checkout that was never installed
        number = "unknown"
    return f"fleetrl {number} (wire protocol {PROTOCOL_VERSION})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrl", description="Asynchronous actor-learner RL post-training with bounded staleness")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    p_learner = sub.add_parser("learner", help="run the learner (rank 0 hosts the hub)")
    p_learner.add_argument("--config", default=None, help="TOML file (required unless --resume: then RUN_DIR/config.toml)")
    p_learner.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest complete checkpoint (run.dir is set to RUN_DIR)",
    )
    p_actor = sub.add_parser("actor", help="run one actor (one inference engine)")
    p_actor.add_argument("--learner", required=True, help="hub address, tcp://HOST:PORT")
    p_actor.add_argument("--config", required=True)
    p_actor.add_argument("--id", default=None, help="actor id (default: host-pid-random)")
    p_demo = sub.add_parser("demo", help="learner + actors on this machine (the embedded default run)")
    p_demo.add_argument("--config", default=None, help="TOML file (default: the built-in demo settings)")
    p_plan = sub.add_parser("plan", help="print the run's plan (placement, batch arithmetic, run length, memory)")
    p_plan.add_argument("--check", action="store_true", help="then run `fleetrl check` on the same config")
    p_check = sub.add_parser("check", help="verify that the model, tokenizer, data and reward load; starts nothing")
    p_config = sub.add_parser("config", help="print every config field with its default and doc (--list), or a config file resolved")
    p_config.add_argument("--list", action="store_true", help="every field, its default and its doc, as TOML")
    for p in (p_plan, p_check, p_config):
        p.add_argument("config_file", nargs="?", default=None, metavar="CONFIG", help="TOML file (or --config FILE)")
        p.add_argument("--config", default=None, help="TOML file")
    p_keys = sub.add_parser("keys", help="generate CURVE keys: the learner's key pair and one key pair per client")
    p_keys.add_argument("--out", required=True, help="key folder (created; an existing server key is kept)")
    p_keys.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="NAME",
        help="a client key pair to add (repeat; default: one named 'actors' when DIR is new)",
    )
    for p in (p_learner, p_actor, p_demo, p_plan, p_check, p_config):
        p.add_argument("overrides", nargs="*", metavar="section.field=value")
    _add_ops_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.cfg = None  # the loaded config, once there is one: it says where the log file is
    before = current_log_file()
    try:
        return _run(args, argv)
    except BrokenPipeError:  # `fleetrl config --list | head`: the reader has gone, nothing went wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python's exit flush fails again
        return 0
    except Exception as e:  # the boundary: one line for a user mistake, the traceback to the log file
        set_up = current_log_file()  # the one this command's process set up, if it got that far
        return report(args.command, e, set_up if set_up != before else _log_file(args))


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.command in ("ctl", "status"):
        return _run_ops(args)
    if args.command == "keys":
        return _keys(args.out, args.client)
    if args.command in ("plan", "check", "config"):
        return _run_offline(args)
    if args.command == "learner":
        args.config, args.overrides = _learner_config(args)
    cfg = args.cfg = load_config(args.config, args.overrides)
    from protocol import auth

    # Key files and model folders are checked before anything starts (and, for a learner group, before torchrun).
    if args.command == "learner" and os.environ.get("RANK", "0") == "0":
        auth.server_keys(cfg)
    if args.command == "actor":
        check_address(args.learner, "--learner")
        auth.client_keys(cfg, args.learner)
    if args.command in ("learner", "actor"):
        from learner.model_files import check_model_paths

        check_model_paths(cfg)
    if args.command == "learner":
        ranks = cfg.cluster.debug_gpus or cfg.cluster.learner_nodes * cfg.cluster.learner_gpus_per_node
        if ranks > 1 and "RANK" not in os.environ:
            return _exec_torchrun(cfg, ranks, argv if argv is not None else sys.argv[1:])
        from learner.main import run_learner

        return run_learner(cfg, resume=args.resume is not None)
    if args.command == "actor":
        from deploy.check import check_reward_import

        check_reward_import(cfg)
        from actors.main import run_actor

        return run_actor(cfg, args.learner, args.id)
    from deploy.launch import run_demo
    from protocol.logs import setup_logging

    setup_logging("launcher", Path(cfg.run.dir) / "logs" / "launcher.jsonl")
    return run_demo(cfg)


def _run_offline(args: argparse.Namespace) -> int:
    """plan, check, config: read the config, start nothing."""
    if args.command == "config" and args.list:
        from deploy.config_list import render as render_fields
        from deploy.config_list import sections

        prefix = args.config_file or args.config or ""
        if args.overrides:
            raise UsageError(f"--list [PREFIX]: unexpected {' '.join(args.overrides)}")
        text = render_fields(prefix)
        if not text:
            raise UsageError(
                f"--list {prefix}: no field's name starts with {prefix!r} (sections: {', '.join(name for name, _ in sections())})"
            )
        print(text, end="")
        return 0
    path, overrides = _config_argument(args)
    cfg = args.cfg = load_config(path, overrides)
    if args.command == "config":
        from protocol.config import dump_toml

        print(dump_toml(cfg), end="")
        return 0
    if args.command == "plan":
        from learner.plan import make_plan, render

        print(render(make_plan(cfg)), end="")
        if not args.check:
            return 0
        print()
    from deploy.check import run_check
    from protocol.logs import setup_logging

    setup_logging("check", level=logging.WARNING)  # the loaders' info lines would repeat what check prints
    run_check(cfg, sys.stdout)
    return 0


def _config_argument(args: argparse.Namespace) -> tuple[str, list[str]]:
    """`plan FILE ...` or `plan --config FILE ...`. With --config, argparse gives the first override to CONFIG."""
    overrides = list(args.overrides)
    if args.config is not None:
        if args.config_file is not None:
            overrides.insert(0, args.config_file)
        return args.config, overrides
    if args.config_file is None or "=" in args.config_file:
        raise UsageError(f"a config file is required: fleetrl {args.command} CONFIG [section.field=value ...] (or --config CONFIG)")
    return args.config_file, overrides


def _log_file(args: argparse.Namespace) -> Path | None:
    """Where a command's traceback goes before its process set up logging: the log it would have written."""
    cfg: Config | None = args.cfg
    if cfg is None or (args.command in ("plan", "config") and not getattr(args, "check", False)):
        return None  # the config itself is the mistake: its one line says all there is, and these write nothing
    logs = Path(cfg.run.dir) / "logs"
    if args.command == "learner":
        return learner_log_file(Path(cfg.run.dir), int(os.environ.get("RANK", "0")))
    if args.command == "actor":
        return logs / f"actor-{args.id}.jsonl" if args.id else logs / "actor.jsonl"
    return logs / ("launcher.jsonl" if args.command == "demo" else "check.jsonl")


def check_address(address: str, name: str) -> None:
    """tcp://HOST:PORT with a host that resolves: ZeroMQ connects to anything and would wait forever."""
    port = tcp_port(address)
    if port is None:
        raise UsageError(f"{name} {address!r}: expected tcp://HOST:PORT with PORT in 1-65535, e.g. tcp://10.0.0.1:5555")
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(
            f"{name} {address}: host {host!r} does not resolve ({e.strerror}); give the learner node's name or IP address"
        ) from e


def _learner_config(args: argparse.Namespace) -> tuple[str, list[str]]:
    """--resume RUN_DIR: the run's own resolved config unless --config is given; run.dir is RUN_DIR."""
    if args.resume is None:
        if args.config is None:
            raise UsageError("--config FILE is required (or --resume RUN_DIR)")
        return args.config, args.overrides
    from learner.run_layout import latest_checkpoint

    run_dir = Path(args.resume)
    config = args.config or str(run_dir / "config.toml")
    if latest_checkpoint(run_dir) is None:
        raise UsageError(f"--resume {run_dir}: no complete checkpoint with training state in {run_dir / 'checkpoints'}")
    return config, [*args.overrides, f"run.dir={run_dir}"]


def _add_ops_commands(sub) -> None:
    """`fleetrl ctl` and `fleetrl status`: clients of a running learner's hub socket (no config file)."""
    from protocol.messages import CONTROL_KEYS

    p_ctl = sub.add_parser("ctl", help="change a setting of a running learner (e.g. set max_staleness 2)")
    p_status = sub.add_parser("status", help="live table of a running learner and its actors")
    for p in (p_ctl, p_status):
        p.add_argument("--learner", required=True, help="hub address, tcp://HOST:PORT")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the learner's reply")
        p.add_argument("--server-key", default="", help="the learner's public key file (KEYS/server.key), when CURVE is on")
        p.add_argument("--client-key", default="", help="this operator's key pair file (KEYS/clients/NAME.key_secret)")
    p_ctl.add_argument("action", choices=["set"])
    p_ctl.add_argument("key", choices=CONTROL_KEYS)
    p_ctl.add_argument("value", type=int)
    p_status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p_status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")


def _run_ops(args) -> int:
    from protocol.auth import ops_client_keys

    check_address(args.learner, "--learner")
    keys = ops_client_keys(args.learner, args.server_key, args.client_key)
    if args.command == "ctl":
        from deploy.ctl import run_ctl

        return run_ctl(args.learner, args.action, args.key, args.value, args.timeout, keys)
    from deploy.status import run_status

    return run_status(args.learner, args.once, args.interval, args.timeout, keys)


def _keys(out: str, clients: list[str]) -> int:
    from protocol import auth

    folder = Path(out)
    if not clients and (folder / "server.key_secret").exists():
        print(f"fleetrl keys: {folder} has a server key already; name the clients to add with --client NAME", file=sys.stderr)
        return 2
    try:
        written = auth.generate(folder, clients or ["actors"])
    except ValueError as e:
        print(f"fleetrl keys: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(
        f"learner: auth.server_secret={folder / 'server.key_secret'} auth.authorized={folder / 'authorized'}\n"
        f"clients: auth.server_key={folder / 'server.key'} auth.client_key={folder / 'clients'}/NAME.key_secret\n"
        "Copy server.key and one clients/NAME.key_secret to each client node; keep the secrets mode 0600. "
        "A running learner admits a key added to authorized/ within a second; delete the file to revoke it."
    )
    return 0


def _exec_torchrun(cfg, ranks: int, argv: list[str]) -> int:
    """One command starts the whole learner group on this node: re-run this command under torchrun.

    Several nodes need one torchrun per node with a shared rendezvous: deploy/learner.sh.
    """
    if cfg.cluster.learner_nodes > 1 and not cfg.cluster.debug_gpus:
        raise ConfigError(
            f"cluster.learner_nodes: {cfg.cluster.learner_nodes} nodes: start each node with "
            "deploy/learner.sh (torchrun with a shared rendezvous)"
        )
    from protocol.net import free_port

    # deploy/torchrun.py is torchrun with our error boundary: one line per distinct rank error, not N tracebacks.
    cmd = [
        sys.executable,
        "-m",
        "deploy.torchrun",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "deploy.cli",
        *argv,
    ]
    os.execv(sys.executable, cmd)  # keeps the PID: a supervisor's SIGTERM reaches torchrun, which stops every rank
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
