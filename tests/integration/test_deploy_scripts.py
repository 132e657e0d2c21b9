"""The launch scripts, rendered: `bash -n` on each, then FLEETRL_DRY_RUN=1 (print each command instead of
starting it) under the environment Slurm or a shell would give them. The srun, torchrun and ssh command lines
are checked, torchrun's with torch's own argument parser and every override with the real config loader.

The same scripts run under a real Slurm in tests/slurm/ (where root and apt are available).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from protocol import auth
from protocol.config import dump_toml, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("deploy/*.sh"), *ROOT.glob("deploy/slurm/*.sbatch")])
CLUSTER = [
    "cluster.learner_nodes=2",
    "cluster.learner_gpus_per_node=4",
    "cluster.actor_nodes=3",
    "cluster.actor_gpus_per_node=8",
    "cluster.tensor_parallel_size=2",
    "hub.bind=tcp://127.0.0.1:6000",
]


def render(script: Path, args: list[str], env: dict[str, str], cwd: Path, code: int = 0) -> list[list[str]]:
    """Run `script` dry; its printed command lines, split as a shell would."""
    full = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/"),
        "FLEETRL_DRY_RUN": "1",
        "FLEETRL_PYTHON": sys.executable,
        **env,
    }
    proc = subprocess.run(["bash", str(script), *args], env=full, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading --name=value options of a command (after its name), and the rest."""
    opts, i = {}, 1
    while i < len(argv) and argv[i].startswith("--"):
        name, _, value = argv[i].partition("=")
        opts[name] = value
        i += 1
    return opts, argv[i:]


def env_prefix(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`env A=1 B=2 cmd ...` -> ({A: 1, B: 2}, [cmd, ...])."""
    assert argv[0] == "env"
    i = 1
    while "=" in argv[i]:
        i += 1
    return dict(a.split("=", 1) for a in argv[1:i]), argv[i:]


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "run.toml"
    keys = auth.key_overrides(tmp_path / "keys")  # the hub binds a cluster address: CURVE is required
    path.write_text(dump_toml(load_config(None, [f"run.dir={tmp_path / 'run'}", *CLUSTER, *keys])))
    return path


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_parses(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_hetjob_renders_the_learner_group_and_the_actor_nodes(config, tmp_path):
    slurm = {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2",
        "SLURM_JOB_NUM_NODES_HET_GROUP_1": "3",
        "FLEETRL_LEARNER_ADDR": "10.1.2.3",
    }
    learner, actors = render(ROOT / "deploy/slurm/fleet.sbatch", [str(config), "train.lr=0.001"], slurm, tmp_path)
    run_dir = str(tmp_path / "run")
    hub = "tcp://10.1.2.3:6000"  # the config's hub port on learner node 0's address
    assert not (tmp_path / "run" / "hub_address").exists()  # a preview: no learner will be behind it
    common = [f"run.dir={run_dir}", f"hub.bind={hub}", "weights.host=10.1.2.3"]

    # Component 0: one task per node; any rank failing kills the step (the learner group is all or nothing).
    opts, rest = options(learner)
    assert learner[0] == "srun" and opts == {"--het-group": "0", "--nodes": "2", "--ntasks-per-node": "1", "--kill-on-bad-exit": "1"}
    env, cmd = env_prefix(rest)
    assert env == {"NNODES": "2", "NPROC_PER_NODE": "4", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    assert cmd == ["bash", str(ROOT / "deploy/learner.sh"), str(config), "train.lr=0.001", *common]

    # What srun runs on learner node 1: torchrun with that node's rank, as torch's own parser reads it.
    (torchrun,) = render(Path(cmd[1]), cmd[2:], {**env, "SLURM_NODEID": "1"}, tmp_path)
    assert torchrun[:3] == [sys.executable, "-m", "deploy.torchrun"]  # torchrun's arguments, our error boundary
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(torchrun[3:])
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "4")
    assert (args.master_addr, args.master_port, args.module, args.training_script) == ("10.1.2.3", 29500, True, "deploy.cli")
    assert args.training_script_args == ["learner", "--config", str(config), "train.lr=0.001", *common]
    cfg = load_config(config, args.training_script_args[3:])  # the overrides are valid and land where meant
    assert (cfg.hub.bind, cfg.weights.host, cfg.run.dir, cfg.train.lr) == (hub, "10.1.2.3", run_dir, 0.001)

    # Component 1: actors.sh per node, 8 GPUs / TP 2 = 4 actors of 2 GPUs; a failing node does not kill the others.
    opts, rest = options(actors)
    assert actors[0] == "srun" and opts == {"--het-group": "1", "--nodes": "3", "--ntasks-per-node": "1", "--kill-on-bad-exit": "0"}
    assert rest[:2] == ["bash", str(ROOT / "deploy/actors.sh")]
    per_node = render(Path(rest[1]), rest[2:], {}, tmp_path)
    assert len(per_node) == 4
    for i, line in enumerate(per_node):
        env, cmd = env_prefix(line)
        assert env == {"CUDA_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}"}
        assert cmd[:5] == [sys.executable, "-m", "deploy.cli", "actor", "--learner"] and cmd[5] == hub
        assert cmd[6:8] == ["--config", str(config)] and cmd[8] == "--id" and cmd[9].endswith(f"-a{i}")
        assert load_config(config, cmd[10:]).run.dir == run_dir  # the actors log into the shared run directory


def test_actor_ids_are_unique_across_slurm_jobs_on_one_node(config, tmp_path):
    """Two jobs' actors.sh on one node (two add_actors jobs, say) named their actors `$(hostname)-aN` alike: the hub
    took each for the other (one connection per id) and both wrote one log file. Under Slurm the id names the
    job and the step."""
    args = ["--learner", "tcp://10.1.2.3:6000", "--config", str(config), "--count", "2"]
    ids = {}
    for job, step in (("41", "0"), ("42", "0"), ("42", "1")):
        lines = render(ROOT / "deploy/actors.sh", args, {"SLURM_JOB_ID": job, "SLURM_STEP_ID": step}, tmp_path)
        ids[job, step] = [line[line.index("--id") + 1] for line in lines]
    every = [i for v in ids.values() for i in v]
    assert len(set(every)) == len(every) == 6, ids
    assert all(i.endswith(f"-j{job}.{step}-a{n}") for (job, step), v in ids.items() for n, i in enumerate(v))
    (plain,) = render(ROOT / "deploy/actors.sh", [*args[:4], "--count", "1"], {}, tmp_path)
    assert plain[plain.index("--id") + 1].endswith("-a0") and "-j" not in plain[plain.index("--id") + 1]  # without Slurm


def test_hetjob_refuses_an_allocation_that_does_not_match_the_config(config, tmp_path):
    base = {"SLURM_SUBMIT_DIR": str(ROOT), "FLEETRL_LEARNER_ADDR": "10.1.2.3"}
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy/slurm/fleet.sbatch"), str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **os.environ,
            **base,
            "FLEETRL_DRY_RUN": "1",
            "FLEETRL_PYTHON": sys.executable,
            "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1",
            "SLURM_JOB_NUM_NODES_HET_GROUP_1": "3",
        },
    )
    assert proc.returncode == 2 and "cluster.learner_nodes = 2 but Slurm gave component 0 1 node(s)" in proc.stderr
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy/slurm/fleet.sbatch"), str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **base, "FLEETRL_DRY_RUN": "1", "FLEETRL_PYTHON": sys.executable},
    )
    assert proc.returncode == 2 and "not a heterogeneous job" in proc.stderr
    bad = subprocess.run(
        ["bash", str(ROOT / "deploy/slurm/fleet.sbatch"), str(config), "cluster.tensor_parallel_size=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **base, "FLEETRL_PYTHON": sys.executable},
    )
    assert bad.returncode == 2 and "cluster.tensor_parallel_size: 3 does not divide cluster.actor_gpus_per_node = 8" in bad.stderr


def test_add_actors_attaches_to_the_running_jobs_hub(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "hub_address").write_text("tcp://10.1.2.3:6000\n")  # written by fleet.sbatch
    (run_dir / "config.toml").write_text(dump_toml(load_config(None, [f"run.dir={run_dir}", *CLUSTER])))  # by the learner
    env = {"SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NUM_NODES": "2"}
    (line,) = render(ROOT / "deploy/slurm/add_actors.sbatch", [str(run_dir)], env, tmp_path)
    opts, rest = options(line)
    assert line[0] == "srun" and opts == {"--nodes": "2", "--ntasks-per-node": "1", "--kill-on-bad-exit": "0"}
    assert rest == [
        "bash",
        str(ROOT / "deploy/actors.sh"),
        "--learner",
        "tcp://10.1.2.3:6000",
        "--config",
        str(run_dir / "config.toml"),
        "--count",
        "4",
        "--gpus-per-actor",
        "2",
    ]
    (line,) = render(ROOT / "deploy/slurm/add_actors.sbatch", [str(run_dir)], {**env, "FLEETRL_ACTORS_PER_NODE": "1"}, tmp_path)
    assert line[line.index("--count") + 1] == "1"  # nodes with fewer GPUs
    # No learner in that run directory: it waits FLEETRL_WAIT_S, then fails saying what is missing.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy/slurm/add_actors.sbatch"), str(empty)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **env, "FLEETRL_WAIT_S": "1", "FLEETRL_PYTHON": sys.executable},
    )
    assert proc.returncode == 1 and f"no running learner in {empty}" in proc.stderr


def test_fleet_sh_starts_actors_on_each_host_over_ssh(config, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# actor machines\ngpu-a\n\ngpu-b  # the spare\n")
    lines = render(
        ROOT / "deploy/fleet.sh",
        [
            "--learner",
            "tcp://10.1.2.3:6000",
            "--config",
            str(config),
            "--hosts",
            str(hosts),
            "--remote-dir",
            "/shared/fleetrl",
            "train.lr=0.001",
        ],
        {},
        tmp_path,
    )
    assert [line[:7] for line in lines] == [["ssh", "-tt", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", h] for h in ("gpu-a", "gpu-b")]
    for line in lines:
        (remote,) = line[7:]  # one string, parsed by the remote shell
        assert shlex.split(remote) == [
            "cd",
            "/shared/fleetrl",
            "&&",
            "bash",
            "deploy/actors.sh",
            "--learner",
            "tcp://10.1.2.3:6000",
            "--config",
            str(config),
            "--count",
            "4",
            "--gpus-per-actor",
            "2",
            "train.lr=0.001",
        ]
    (line,) = render(
        ROOT / "deploy/fleet.sh", ["--learner", "tcp://h:1", "--config", str(config), "--hosts", "one", "--count", "2"], {}, tmp_path
    )
    assert shlex.split(line[7])[shlex.split(line[7]).index("--count") + 1] == "2"


def test_learner_sh_on_one_node_runs_fleetrl_learner(config, tmp_path):
    (line,) = render(ROOT / "deploy/learner.sh", [str(config), "train.lr=0.001"], {}, tmp_path)
    assert line == [sys.executable, "-m", "deploy.cli", "learner", "--config", str(config), "train.lr=0.001"]
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy/learner.sh"), str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "NNODES": "2", "FLEETRL_DRY_RUN": "1", "MASTER_ADDR": "x"},
    )
    assert proc.returncode != 0 and "set NODE_RANK" in proc.stderr


def test_hetjob_makes_curve_keys_when_the_config_names_none(tmp_path):
    """A hub on a cluster address needs CURVE: with no keys in the config, the job writes a set into the run
    directory (shared by every node) and hands it to the learner and the actors; the resolved config keeps it."""
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(load_config(None, [f"run.dir={tmp_path / 'run'}", *CLUSTER])))  # loopback, no keys
    slurm = {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2",
        "SLURM_JOB_NUM_NODES_HET_GROUP_1": "3",
        "FLEETRL_LEARNER_ADDR": "10.1.2.3",
    }
    learner, actors = render(ROOT / "deploy/slurm/fleet.sbatch", [str(config)], slurm, tmp_path)
    keys = tmp_path / "run" / "keys"
    overrides = [
        f"auth.server_secret={keys / 'server.key_secret'}",
        f"auth.authorized={keys / 'authorized'}",
        f"auth.server_key={keys / 'server.key'}",
        f"auth.client_key={keys / 'clients' / 'actors.key_secret'}",
    ]
    _, learner_cmd = env_prefix(options(learner)[1])
    assert learner_cmd[-4:] == overrides and actors[-4:] == overrides
    cfg = load_config(config, learner_cmd[3:])  # a cluster address with CURVE: valid, and the key files exist
    assert cfg.hub.bind == "tcp://10.1.2.3:6000" and auth.server_keys(cfg) is not None and auth.client_keys(cfg, cfg.hub.bind) is not None
    # A second submission keeps the keys (running actors of add_actors.sbatch hold them).
    before = (keys / "server.key_secret").read_bytes()
    render(ROOT / "deploy/slurm/fleet.sbatch", [str(config)], slurm, tmp_path)
    assert (keys / "server.key_secret").read_bytes() == before


def test_hetjob_dry_run_checks_the_config_with_the_jobs_overrides(tmp_path):
    """auth.curve = off is fine on loopback, and refused once the job binds the hub to the node's address: the dry
    run says so, before any node would start and fail."""
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(load_config(None, [f"run.dir={tmp_path / 'run'}", *CLUSTER, "auth.curve=off"])))
    slurm = {
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2",
        "SLURM_JOB_NUM_NODES_HET_GROUP_1": "3",
        "FLEETRL_LEARNER_ADDR": "10.1.2.3",
        "FLEETRL_DRY_RUN": "1",
        "FLEETRL_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy/slurm/fleet.sbatch"), str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **slurm},
    )
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("fleetrl: config error: auth.curve") and "10.1.2.3" in line
