"""`fleetrl`: the command line. One process, one entry point; the launcher composes them.

    fleetrl learner --config FILE [section.field=value ...]
    fleetrl learner --resume RUN_DIR [--config FILE] [section.field=value ...]   continue from RUN_DIR's last checkpoint
    fleetrl actor   --learner tcp://HOST:PORT --config FILE [--id NAME] [section.field=value ...]
    fleetrl demo    [--config FILE] [section.field=value ...]
    fleetrl plan    CONFIG [section.field=value ...]      placement, batch arithmetic, run length, memory; starts nothing
    fleetrl ctl     --learner tcp://HOST:PORT set max_staleness K     change a running learner's setting
    fleetrl status  --learner tcp://HOST:PORT [--once]                  live view of the learner and its actors
                    (both: --server-key F --client-key F for a hub with CURVE on)
    fleetrl keys    --out DIR [--client NAME ...]          CURVE keys: the learner's pair, one pair per client
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from protocol.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl", description="Asynchronous actor-learner RL post-training with bounded staleness")
    sub = parser.add_subparsers(dest="command", required=True)
    p_learner = sub.add_parser("learner", help="run the learner (rank 0 hosts the hub)")
    p_learner.add_argument("--config", default=None, help="TOML file (required unless --resume: then RUN_DIR/config.toml)")
    p_learner.add_argument("--resume", default=None, metavar="RUN_DIR",
                           help="continue the run in RUN_DIR from its newest complete checkpoint (run.dir is set to RUN_DIR)")
    p_actor = sub.add_parser("actor", help="run one actor (one inference engine)")
    p_actor.add_argument("--learner", required=True, help="hub address, tcp://HOST:PORT")
    p_actor.add_argument("--config", required=True)
    p_actor.add_argument("--id", default=None, help="actor id (default: host-pid-random)")
    p_demo = sub.add_parser("demo", help="learner + actors on this machine (the embedded default run)")
    p_demo.add_argument("--config", default=None, help="TOML file (default: the built-in demo settings)")
    p_plan = sub.add_parser("plan", help="print the run's plan (placement, batch arithmetic, run length, memory)")
    p_plan.add_argument("config", help="TOML file")
    p_keys = sub.add_parser("keys", help="generate CURVE keys: the learner's key pair and one key pair per client")
    p_keys.add_argument("--out", required=True, help="key folder (created; an existing server key is kept)")
    p_keys.add_argument("--client", action="append", default=[], metavar="NAME",
                        help="a client key pair to add (repeat; default: one named 'actors' when DIR is new)")
    for p in (p_learner, p_actor, p_demo, p_plan):
        p.add_argument("overrides", nargs="*", metavar="section.field=value")
    _add_ops_commands(sub)
    args = parser.parse_args(argv)
    if args.command in ("ctl", "status"):
        return _run_ops(args)
    if args.command == "keys":
        return _keys(args.out, args.client)

    try:
        if args.command == "learner":
            args.config, args.overrides = _learner_config(args)
        cfg = load_config(args.config, args.overrides)
        if args.command == "plan":
            from learner.plan import make_plan, render

            print(render(make_plan(cfg)), end="")
            return 0
        from protocol import auth

        # Key files are checked before anything starts: a missing or world-readable key is a config error.
        if args.command == "learner" and os.environ.get("RANK", "0") == "0":
            auth.server_keys(cfg)
        if args.command == "actor":
            auth.client_keys(cfg, args.learner)
    except ConfigError as e:
        print(f"fleetrl: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "learner":
        ranks = cfg.cluster.debug_gpus or cfg.cluster.learner_nodes * cfg.cluster.learner_gpus_per_node
        if ranks > 1 and "RANK" not in os.environ:
            return _exec_torchrun(cfg, ranks, argv if argv is not None else sys.argv[1:])
        from learner.main import run_learner

        return run_learner(cfg, resume=args.resume is not None)
    if args.command == "actor":
        if not args.learner.startswith("tcp://"):
            print(f"fleetrl: --learner {args.learner!r}: expected tcp://HOST:PORT", file=sys.stderr)
            return 2
        from actors.main import run_actor

        return run_actor(cfg, args.learner, args.id)
    from deploy.launch import run_demo
    from protocol.logs import setup_logging

    setup_logging("launcher")
    return run_demo(cfg)


def _learner_config(args: argparse.Namespace) -> tuple[str, list[str]]:
    """--resume RUN_DIR: the run's own resolved config unless --config is given; run.dir is RUN_DIR."""
    if args.resume is None:
        if args.config is None:
            raise ConfigError("fleetrl learner: --config FILE is required (or --resume RUN_DIR)")
        return args.config, args.overrides
    from learner.resume import latest_checkpoint

    run_dir = Path(args.resume)
    config = args.config or str(run_dir / "config.toml")
    if latest_checkpoint(run_dir) is None:
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint with training state in {run_dir / 'checkpoints'}")
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
    if not args.learner.startswith("tcp://"):
        print(f"fleetrl: --learner {args.learner!r}: expected tcp://HOST:PORT", file=sys.stderr)
        return 2
    from protocol.auth import ops_client_keys
    from protocol.config import ConfigError

    try:
        keys = ops_client_keys(args.learner, args.server_key, args.client_key)
    except ConfigError as e:
        print(f"fleetrl {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "ctl":
        from deploy.ctl import run_ctl

        return run_ctl(args.learner, args.action, args.key, args.value, args.timeout, keys)
    from deploy.status import run_status

    return run_status(args.learner, args.once, args.interval, args.timeout, keys)


def _keys(out: str, clients: list[str]) -> int:
    from pathlib import Path

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
    print(f"learner: auth.server_secret={folder / 'server.key_secret'} auth.authorized={folder / 'authorized'}\n"
          f"clients: auth.server_key={folder / 'server.key'} auth.client_key={folder / 'clients'}/NAME.key_secret\n"
          "Copy server.key and one clients/NAME.key_secret to each client node; keep the secrets mode 0600. "
          "A running learner admits a key added to authorized/ within a second; delete the file to revoke it.")
    return 0


def _exec_torchrun(cfg, ranks: int, argv: list[str]) -> int:
    """One command starts the whole learner group on this node: re-run this command under torchrun.

    Several nodes need one torchrun per node with a shared rendezvous: deploy/learner.sh.
    """
    if cfg.cluster.learner_nodes > 1 and not cfg.cluster.debug_gpus:
        print(f"fleetrl: cluster.learner_nodes = {cfg.cluster.learner_nodes}: start each node with deploy/learner.sh "
              "(torchrun with a shared rendezvous)", file=sys.stderr)
        return 2
    from protocol.net import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "deploy.cli", *argv]
    os.execv(sys.executable, cmd)  # keeps the PID: a supervisor's SIGTERM reaches torchrun, which stops every rank
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
