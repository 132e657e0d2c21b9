"""Submit a FleetRL job to Slurm, sized by the config: what `deploy/slurm/submit.sh` runs.

    python -m deploy.submit CONFIG [section.field=value ...]                      fleet.sbatch, a heterogeneous job
    python -m deploy.submit --resume RUN_DIR [section.field=value ...]            the same, continuing RUN_DIR
    python -m deploy.submit --add-actors RUN_DIR [--nodes N] [section.field=value ...]   add_actors.sbatch

The config decides what each node needs: `actor.device = "cpu"` is a CPU fleet (Slurm is asked for no GPU: the
weight group is gloo, so the learner is on CPUs too); otherwise learner nodes ask for
`cluster.learner_gpus_per_node` GPUs each and actor nodes for `cluster.actor_gpus_per_node` (`--gpus-per-node`).
Component sizes are `cluster.learner_nodes` and `cluster.actor_nodes`.

Before sbatch, the request is checked against the partition (`sinfo`), because Slurm accepts some wrong requests
and then pends forever: the components of a heterogeneous job never share a node, so it needs
learner_nodes + actor_nodes nodes; a GPU request on nodes without GPUs fails in sbatch with "Invalid generic
resource (gres) specification", which says nothing about the config. Either is one line here, exit 2.
FLEETRL_SBATCH adds sbatch options to every component (e.g. "--partition=gpu --time=24:00:00 --account=x");
FLEETRL_DRY_RUN=1 prints the sbatch command instead of running it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.jobenv import gpu_fleet
from protocol.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "deploy" / "slurm"
NODE_STATES_DOWN = ("down", "drain", "drng", "fail", "maint", "futr", "inval", "unk")


class SubmitError(ValueError):
    """The request cannot run on this cluster: one line, exit 2."""


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpus: int  # GPUs in its gres (gpu:8, gpu:a100:8); 0 for a CPU node
    state: str


def components(cfg: Config) -> list[list[str]]:
    """sbatch options of the learner component, then of the actor component. Each gets --requeue (a job that Slurm
    requeues or preempts starts again and resumes, fleet.sbatch); the first, whose node runs the batch script, gets
    --signal=B:USR1@N with cluster.time_limit_grace_s (the script checkpoints and requeues the job before its time
    limit), and --open-mode=append: the batch script's output file (on that node) keeps every start's lines, where
    Slurm would truncate it at each start again. FLEETRL_SBATCH comes after them: "--no-requeue" there turns
    requeueing off."""
    c = cfg.cluster
    out = []
    for nodes, gpus in ((c.learner_nodes, c.learner_gpus_per_node), (c.actor_nodes, c.actor_gpus_per_node)):
        out.append([f"--nodes={nodes}", *([f"--gpus-per-node={gpus}"] if gpu_fleet(cfg) else [])])
    out[0] += [f"--signal=B:USR1@{c.time_limit_grace_s}"] if c.time_limit_grace_s else []
    for options in out:
        options.append("--requeue")  # each component: a cluster with JobRequeue=0 defaults every one to no
    out[0].append("--open-mode=append")
    return out


def parse_gres(gres: str) -> int:
    """GPUs in an sinfo %G field: "gpu:8", "gpu:a100:4(S:0-1)", "gpu:2,shard:8"; "(null)" is none."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_nodes(partition: str | None) -> list[Node]:
    argv = ["sinfo", "-h", "-N", "-o", "%N %G %t", *([f"--partition={partition}"] if partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    except FileNotFoundError as e:
        raise SubmitError("sinfo not found: submit from a Slurm login node") from e
    except subprocess.CalledProcessError as e:
        raise SubmitError(f"sinfo failed: {e.stderr.strip()}") from e
    nodes: dict[str, Node] = {}
    for line in out.splitlines():
        name, gres, state = line.split()
        nodes[name] = Node(name, parse_gres(gres), state.rstrip("*~#!%$@^-"))
    return list(nodes.values())


def check_fits(cfg: Config, nodes: list[Node], partition: str | None, learner: bool = True, actor_nodes: int | None = None) -> None:
    """Raise SubmitError if the job could never start on `nodes` (the partition's)."""
    c = cfg.cluster
    where = f"partition {partition}" if partition else "the default partition"
    usable = [n for n in nodes if n.state not in NODE_STATES_DOWN]
    wanted = [("learner", c.learner_nodes, c.learner_gpus_per_node)] if learner else []
    wanted.append(("actor", c.actor_nodes if actor_nodes is None else actor_nodes, c.actor_gpus_per_node))
    if gpu_fleet(cfg):
        for role, count, gpus in wanted:
            fit = [n for n in usable if n.gpus >= gpus]
            if len(fit) < count:
                best = max((n.gpus for n in usable), default=0)
                raise SubmitError(
                    f"actor.device = {cfg.actor.device!r} asks for GPU nodes: {count} {role} node(s) with "
                    f"cluster.{role}_gpus_per_node = {gpus} GPUs, but {where} has {len(fit)} (most GPUs on a node: {best}); "
                    "on CPU nodes set actor.device=cpu"
                )
    need = sum(count for _, count, _ in wanted)
    if len(usable) < need:
        parts = " + ".join(f"cluster.{role}_nodes = {count}" for role, count, _ in wanted)
        raise SubmitError(
            f"the job needs {parts} = {need} nodes (each component of a heterogeneous job has nodes of its own) "
            f"but {where} has {len(usable)} usable: it would pend forever"
        )


def sbatch_argv(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The sbatch command for `args` (this module's command line), after checking it against the cluster, and the
    environment it adds for the job (sbatch passes the environment on, and Slurm keeps it for a restart)."""
    extra = shlex.split(os.environ.get("FLEETRL_SBATCH", ""))
    partition = next((a.split("=", 1)[1] for a in extra if a.startswith(("--partition=", "-p="))), None)
    if args[:1] == ["--add-actors"]:
        if len(args) < 2:
            raise SubmitError("usage: submit.sh --add-actors RUN_DIR [--nodes N] [section.field=value ...]")
        run_dir, rest = Path(args[1]), args[2:]
        nodes = 1
        if rest[:1] == ["--nodes"] and len(rest) >= 2 and rest[1].isdigit() and int(rest[1]) >= 1:
            nodes, rest = int(rest[1]), rest[2:]
        config = run_dir / "config.toml"
        if not config.is_file():
            raise SubmitError(f"--add-actors {run_dir}: no {config}: the running job's learner writes it when it starts")
        cfg = load_config(config, rest)
        check_fits(cfg, partition_nodes(partition), partition, learner=False, actor_nodes=nodes)
        gpus = [f"--gpus-per-node={cfg.cluster.actor_gpus_per_node}"] if gpu_fleet(cfg) else []
        return ["sbatch", f"--nodes={nodes}", *gpus, *extra, str(SLURM / "add_actors.sbatch"), str(run_dir), *rest], {}
    if args[:1] == ["--resume"]:
        if len(args) < 2:
            raise SubmitError("usage: submit.sh --resume RUN_DIR [section.field=value ...]")
        from learner.run_layout import latest_checkpoint

        run_dir = Path(args[1])
        if latest_checkpoint(run_dir) is None:
            raise SubmitError(f"--resume {run_dir}: no complete checkpoint with training state in {run_dir / 'checkpoints'}")
        cfg = load_config(run_dir / "config.toml", [*args[2:], f"run.dir={run_dir.resolve()}"])  # where it is now
    elif not args or args[0].startswith("-"):
        raise SubmitError(
            "usage: submit.sh CONFIG [section.field=value ...] | --resume RUN_DIR [...] | --add-actors RUN_DIR [--nodes N] [...]"
        )
    else:
        cfg = load_config(args[0], args[1:])
    check_fits(cfg, partition_nodes(partition), partition)
    learner, actors = components(cfg)
    # The run directory as resolved now: a restarted job reads its CONFIG again, which may have been edited since.
    env = {"FLEETRL_RUN_DIR": str(Path(cfg.run.dir).resolve())}
    return ["sbatch", *learner, *extra, ":", *actors, *extra, str(SLURM / "fleet.sbatch"), *args], env


def main(argv: list[str]) -> int:
    from protocol.logs import setup_logging

    setup_logging("submit")  # warnings on stderr: stdout is the sbatch command (FLEETRL_DRY_RUN) or sbatch's own
    try:
        cmd, env = sbatch_argv(argv)
    except (SubmitError, ConfigError) as e:
        print(f"fleetrl submit: {e}", file=sys.stderr)
        return 2
    if os.environ.get("FLEETRL_DRY_RUN"):
        print(shlex.join(cmd))
        return 0
    os.environ.setdefault("FLEETRL_HOME", str(ROOT))  # sbatch passes the environment on: the job finds this checkout
    os.environ.update(env)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
