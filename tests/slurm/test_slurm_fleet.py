"""FleetRL under a real Slurm 22.05 (tests/slurm/cluster.py: slurmctld, slurmd nodes n1-n3 in network namespaces,
each with two GPUs that Slurm allocates and no CUDA behind them), submitted as a user would, with
deploy/slurm/submit.sh and the demo's tiny model: in the documented CPU form (actor.device=cpu), and once in the
documented GPU form.

    n1: learner (het component 0, the batch host)   n2: actors (component 1)   n3: add_actors.sbatch

One long run goes through its life in order: actors added mid-run and detached by scancel, the job requeued three
ways (time limit, scontrol requeue, preemption), the main job scancelled (it checkpoints), then resumed through
fleet.sbatch to the end. A second run has a learner group of two nodes (n1, n2; its actor on n3), and one of its
ranks is SIGKILLed. Each checks
exit codes, the ledger (every prompt of every epoch in exactly one state, trained = steps x prompts per step:
none lost, none trained twice, which the learner also asserts), that no process of the job is left, that
RUN_DIR/hub_address is gone, and that every actor stopped cleanly (no actor.stop_overdue).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import GPUS, Cluster, SlurmUnavailable

from bench.fleet import when

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
SUBMIT = str(ROOT / "deploy" / "slurm" / "submit.sh")
PROMPTS_PER_STEP = 8
LONG = 400  # updates of the long run: it never ends by itself before the test stops it


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The cluster (tests/slurm/cluster.py), started by the first test that needs it and stopped at the end whatever
    happened. Where it cannot run (not root, no apt to install Slurm, no network namespaces) every test skips with
    the one-line reason. Not in a conftest.py: a second module named conftest would shadow tests/conftest.py's
    helpers, which tests import by that name."""
    try:
        cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm cluster here: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


def demo_args(model: Path, steps: int) -> list[str]:
    """The documented CPU command's arguments (docs/deploy.md), plus a short run's settings."""
    documented = [str(ROOT / "configs" / "demo.toml"), "actor.device=cpu", "cluster.actor_gpus_per_node=1", f"model.path={model}"]
    short = [
        f"train.total_steps={steps}",
        f"train.prompts_per_step={PROMPTS_PER_STEP}",
        "rollout.samples_per_prompt=4",
        "train.micro_batch_samples=16",
        "checkpoint.every_steps=2",
    ]
    return documented + short


class Job:
    """A submitted job, its run directory and its logs."""

    def __init__(self, slurm, job_id: str, run_dir: Path):
        self.slurm, self.id, self.run_dir = slurm, job_id, run_dir

    def events(self, log: str) -> list[dict]:
        path = self.run_dir / "logs" / log
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip() and x.endswith("}")]

    def learner(self, event: str) -> list[dict]:
        return [e for e in self.events("learner.jsonl") if e["event"] == event]

    def actors(self, node: str) -> list[str]:
        """Ids of this job's actors on `node` that registered (`NODE-jJOB.STEP-aN`: the step number depends on which
        srun of the het job started first)."""
        prefix = f"{node}-j{self.id}."
        return sorted({e["actor"] for e in self.learner("hub.actor_registered") if e["actor"].startswith(prefix)})

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def submit(slurm, tmp_path: Path, *args: str, code: int = 0, sbatch: str = "") -> subprocess.CompletedProcess:
    env = {**slurm.env, "FLEETRL_SBATCH": f"--output={tmp_path}/%x-%j.out {sbatch}"}
    proc = subprocess.run([SUBMIT, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    return proc


def submitted(slurm, tmp_path: Path, run_dir: Path, *args: str, sbatch: str = "") -> Job:
    out = submit(slurm, tmp_path, *args, sbatch=sbatch).stdout
    assert out.startswith("Submitted batch job "), out
    return Job(slurm, out.split()[-1], run_dir)


def wait_for(what: str, check, timeout: float, job: Job | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        if job is not None:
            assert job.slurm.job_state(job.id) in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job.id} ended waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def processes() -> Iterator[tuple[int, dict[str, str], str]]:
    """(pid, environment, command line) of every process on this machine that can still be read."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield int(pid), dict(e.split("=", 1) for e in environ if "=" in e), cmdline


def job_processes(job_ids: set[str]) -> list[str]:
    """Processes of these jobs (their environment names the job), slurmstepd's included."""
    found = []
    for pid, env, cmdline in processes():
        ids = {env.get("SLURM_JOB_ID"), env.get("SLURM_JOBID")}
        if ids & job_ids or any(f"slurmstepd: [{j}." in cmdline for j in job_ids):
            found.append(f"{pid} {cmdline[:120]}")
    return found


def assert_ended_clean(job: Job, state: str, codes: set[str] | None, actors: list[str], main: bool = True) -> None:
    """Slurm's final state and exit codes (None: any), nothing of the job left 5 s later, no hub_address (for the
    main job: an add_actors job leaves the running job's), clean actor stops."""
    assert job.slurm.wait_done(job.id, 120) == state
    assert codes is None or set(job.slurm.exit_codes(job.id)) == codes, job.slurm.exit_codes(job.id)
    ids = {job.id, str(int(job.id) + 1)}  # a het job's components are the leader's id and the next
    left: list[str] = []
    deadline = time.monotonic() + 5
    while (left := job_processes(ids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    assert not main or not (job.run_dir / "hub_address").exists()
    for actor in actors:
        log = job.events(f"actor-{actor}.jsonl")
        starts = [i for i, e in enumerate(log) if e["event"] == "actor.engine_start.begin"]
        log = log[starts[-1] if starts else 0 :]  # its last life: a requeued job's actor writes on in the same file
        assert [e["exit_code"] for e in log if e["event"] == "actor.stopped"][-1:] == [0], actor
        assert not [e for e in log if e["event"] == "actor.stop_overdue"], actor  # scancel's two SIGTERMs: one clean stop


def assert_ledger_exact(job: Job, steps: int) -> None:
    """Every prompt of every epoch in one state at the learner's end; trained = steps x prompts per step."""
    done = job.learner("learner.done")[-1]
    assert done["updates"] == steps
    ledger = done["ledger"]
    assert sum(ledger.values()) == done["ledger_epochs"] * done["ledger_prompts"], done
    assert ledger["trained"] == steps * PROMPTS_PER_STEP
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each update once, none repeated after a resume
    assert [r["ledger/trained"] for r in rows] == [s * PROMPTS_PER_STEP for s in range(1, steps + 1)]


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> list[str]:
    """CONFIG and overrides, as submit.sh takes them: the demo's tiny model (built once, in FLEETRL_CACHE)."""
    return demo_args(tiny_model_dir, LONG)


def test_a_request_the_cluster_cannot_run_fails_at_submission(slurm, config, tmp_path):
    """Problems 1 and 8: more GPUs per node than the nodes have and more nodes than a het job can get are one line,
    exit 2, before anything is queued; the documented CPU forms are accepted (the old #SBATCH --gpus-per-node=8
    made sbatch refuse every one on CPU nodes with "Invalid generic resource (gres) specification")."""
    run_dir = tmp_path / "run"
    gpu = submit(slurm, tmp_path, *config, f"run.dir={run_dir}", "actor.device=auto", f"cluster.actor_gpus_per_node={GPUS + 2}", code=2)
    (line,) = gpu.stderr.splitlines()
    assert line.startswith("fleetrl submit: actor.device = 'auto' asks for GPU nodes") and "actor.device=cpu" in line
    assert f"cluster.actor_gpus_per_node = {GPUS + 2} GPUs, but the default partition has 0 (most GPUs on a node: {GPUS})" in line
    many = submit(slurm, tmp_path, *config, f"run.dir={run_dir}", "cluster.actor_nodes=3", code=2)
    (line,) = many.stderr.splitlines()
    assert "cluster.learner_nodes = 1 + cluster.actor_nodes = 3 = 4 nodes" in line and "pend forever" in line
    assert slurm.run(["squeue", "-h"]).stdout == ""  # nothing queued
    # By hand, as fleet.sbatch's header documents: sbatch accepts it on CPU nodes.
    proc = subprocess.run(
        ["sbatch", "--hold", f"--output={tmp_path}/%x-%j.out", str(ROOT / "deploy/slurm/fleet.sbatch"), *config, f"run.dir={run_dir}"],
        env=slurm.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    slurm.run(["scancel", proc.stdout.split()[-1]])
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def long_run(slurm, config, tmp_path_factory):
    """The long run's state, handed from one phase's test to the next (they run in file order)."""
    return {"dir": tmp_path_factory.mktemp("slurm-long")}


def test_actors_added_mid_run_and_detached_by_scancel(slurm, config, long_run):
    """add_actors.sbatch attaches an actor on n3 to the running job; scancel detaches it at once and the hub requeues
    what it held. Its id names its job (problem 5: `$(hostname)-aN` collided across jobs on one node)."""
    work = long_run["dir"]
    run_dir = work / "run"
    job = submitted(slurm, work, run_dir, *config, f"run.dir={run_dir}")
    long_run["job"] = job
    wait_for("the job's config.toml", lambda: (run_dir / "config.toml").exists() and (run_dir / "hub_address").exists(), 180, job)
    added = submitted(slurm, work, run_dir, "--add-actors", str(run_dir))
    added_actor = f"n3-j{added.id}.0-a0"
    wait_for(
        "a group from the added actor", lambda: [e for e in job.learner("hub.actor_first_group") if e["actor"] == added_actor], 240, job
    )
    (main_actor,) = job.actors("n2")
    assert {e["actor"] for e in job.learner("hub.actor_registered")} == {main_actor, added_actor}
    assert (run_dir / "logs" / f"actor-{added_actor}.jsonl").exists() and (run_dir / "logs" / f"actor-{main_actor}.jsonl").exists()
    t0 = time.monotonic()
    slurm.run(["scancel", added.id])
    removed = wait_for("the added actor's removal", lambda: [e for e in job.learner("hub.actor_removed") if e["actor"] == added_actor], 30)
    assert time.monotonic() - t0 < 15
    assert removed[0]["requeued"] == len(removed[0]["keys"])  # what it held went back to the queue
    assert_ended_clean(added, "CANCELLED", None, [added_actor], main=False)
    steps = len(job.rows())
    wait_for("the run training on without it", lambda: len(job.rows()) >= steps + 2, 120, job)
    assert slurm.job_state(job.id) == "RUNNING"


def test_a_requeued_job_resumes_by_itself(slurm, long_run):
    """Requeue and preemption, three times on one job: it requeues itself before its time limit (the USR1 that
    submit.sh's --signal=B:USR1@cluster.time_limit_grace_s sends the batch script); Slurm requeues it
    (`scontrol requeue`: SIGTERM, then a start again); a job in the `urgent` partition preempts it (PreemptMode=REQUEUE,
    GraceTime 60 s: SIGTERM to the steps only, and a job whose script ended within its grace time was COMPLETED,
    never started again). Each time the learner checkpoints, the actors stop cleanly, and the job starts again with
    the same arguments and resumes from that checkpoint by itself: no previous-* run set aside, every update's
    metrics row once."""
    job: Job = long_run.get("job") or pytest.skip("needs the long run of test_actors_added_mid_run_and_detached_by_scancel")
    assert slurm.restarts(job.id) == 0
    work = job.run_dir.parent
    preempt = ["sbatch", "--partition=urgent", "--nodelist=n1", "--exclusive", f"--output={work}/urgent-%j.out", "--wrap", "true"]
    hows = (["scancel", "--batch", "--signal=USR1", job.id], ["scontrol", "requeue", job.id], preempt)
    for restart, how in enumerate(hows, start=1):
        trained = len(job.rows())
        wait_for("a checkpoint of this start", lambda n=trained: len(job.rows()) >= n + 2, 120, job)
        slurm.run(how)
        stop = wait_for("the learner's checkpoint", lambda n=restart: job.learner("learner.done")[n - 1 :], 60)[0]
        assert (job.run_dir / "checkpoints" / f"step-{stop['updates']}" / "state").exists()
        # Slurm holds a requeued job back for its credential lifetime (cred_expire, 10 s on this cluster).
        wait_for(f"start {restart + 1}", lambda n=restart: slurm.restarts(job.id) == n and slurm.job_state(job.id) == "RUNNING", 120)
        resumed = wait_for("the resume", lambda n=restart: job.learner("learner.resumed_engines")[n - 1 :], 180)
        assert resumed[0]["checkpoint"].endswith(f"step-{stop['updates']}")
        wait_for("training after the resume", lambda n=stop["updates"]: len(job.rows()) >= n + 2, 180, job)
    (urgent,) = work.glob("urgent-*.out")
    assert slurm.job_state(urgent.stem.removeprefix("urgent-")) == "COMPLETED"  # the preemptor ran in between
    out = (work / f"fleetrl-{job.id}.out").read_text()
    assert f"job {job.id} is being preempted" in out, out[-2000:]
    assert not list(job.run_dir.glob("previous-*"))
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for actor in job.actors("n2"):
        assert not [e for e in job.events(f"actor-{actor}.jsonl") if e["event"] == "actor.stop_overdue"], actor


def test_scancel_stops_the_main_job_cleanly(slurm, long_run):
    """scancel of the whole fleet: the learner checkpoints, the actors stop cleanly (problem 6: a second SIGTERM was
    taken as "kill now"), hub_address is removed (problem 3: it stayed, and add_actors attached to nothing)."""
    job: Job = long_run.get("job") or pytest.skip("needs the long run of test_actors_added_mid_run_and_detached_by_scancel")
    wait_for("a checkpoint", lambda: (job.run_dir / "checkpoints").exists() and any((job.run_dir / "checkpoints").iterdir()), 120, job)
    t0 = time.monotonic()
    slurm.run(["scancel", job.id])
    assert_ended_clean(job, "CANCELLED", {"130:0"}, job.actors("n2"))
    long_run["cancel_s"] = time.monotonic() - t0
    assert long_run["cancel_s"] < 30
    done = job.learner("learner.done")[-1]  # the learner's clean stop: a checkpoint of the step it reached
    assert (job.run_dir / "checkpoints" / f"step-{done['updates']}" / "state").exists()
    long_run["stopped_at"] = done["updates"]


def test_resume_through_fleet_sbatch_to_the_end(slurm, long_run):
    """Problem 4: `submit.sh --resume RUN_DIR` continues the run from its newest checkpoint (fleet.sbatch --resume
    failed with exit 2, and a plain resubmission set the run aside as previous-*). It trains to its end: exit 0 on
    both components, the ledger exact over both jobs, no step trained twice."""
    stopped: int = long_run.get("stopped_at") or pytest.skip("needs the run stopped by test_scancel_stops_the_main_job_cleanly")
    first: Job = long_run["job"]
    steps = stopped + 4
    job = submitted(slurm, long_run["dir"], first.run_dir, "--resume", str(first.run_dir), f"train.total_steps={steps}")
    assert_ended_clean(job, "COMPLETED", {"0:0"}, job.actors("n2"))
    assert len(job.actors("n2")) == 1
    assert_ledger_exact(job, steps)
    resumed = job.learner("learner.resumed_engines")
    assert resumed and resumed[-1]["checkpoint"].endswith(f"step-{stopped}")
    assert not list(first.run_dir.glob("previous-*"))


def process_env(job: Job, argv_part: str, key: str) -> list[str]:
    """`key` from the environment of each process of the job (either component) whose command line has `argv_part`."""
    ids = {job.id, str(int(job.id) + 1)}
    return [env[key] for _, env, cmdline in processes() if argv_part in cmdline and env.get("SLURM_JOB_ID") in ids and key in env]


def test_the_gpu_command_as_documented_on_gpu_nodes(slurm, tiny_model_dir, tmp_path):
    """Item 3's GPU form, `deploy/slurm/submit.sh CONFIG` with no actor.device, on nodes that have GPUs (gres
    gpu:GPUS: Slurm counts and allocates them; no CUDA device is behind them). Each component asks for its
    cluster.*_gpus_per_node and gets them, fleet.sbatch's GPU check passes, and the actor node starts
    actor_gpus_per_node / tensor_parallel_size actors, each on its own GPU. torch sees no CUDA on these nodes, so
    actor.device = "auto" runs the engines and the learner on the CPU: this covers Slurm and the scripts, not CUDA."""
    run_dir = tmp_path / "run"
    steps = 6
    args = [a for a in demo_args(tiny_model_dir, steps) if a not in ("actor.device=cpu", "cluster.actor_gpus_per_node=1")]
    job = submitted(slurm, tmp_path, run_dir, *args, f"run.dir={run_dir}", f"cluster.actor_gpus_per_node={GPUS}")
    assert slurm.gpus_per_node(job.id) == [1, GPUS]  # learner component, actor component

    def actor_gpus() -> list[str]:
        seen = sorted(process_env(job, "deploy.cli actor", "CUDA_VISIBLE_DEVICES"))
        return seen if len(seen) == GPUS else []

    # The actors' processes, while their engines start: one GPU each. (Not their registrations: the run is short,
    # and one actor can finish it alone before the other's engine is up.)
    assert wait_for("the actor node's actors", actor_gpus, 240, job) == [str(i) for i in range(GPUS)]
    assert process_env(job, "deploy.cli actor", "SLURM_GPUS_ON_NODE") == [str(GPUS)] * GPUS
    assert slurm.wait_done(job.id, 240) == "COMPLETED"
    # An actor the hub's stop never reached (the short run may end before its engine is up) used to keep the job
    # 60 s more, waiting for a learner that was gone: fleet.sbatch now waits 10 s, then stops it.
    ended_s = time.time() - when(job.learner("learner.done")[-1])
    assert ended_s < 30, f"the job ended {ended_s:.0f} s after its learner"
    actors = sorted(p.stem.removeprefix("actor-") for p in (run_dir / "logs").glob("actor-*.jsonl"))
    assert len(actors) == GPUS and all(a.startswith(f"n2-j{job.id}.") for a in actors), actors
    assert_ended_clean(job, "COMPLETED", {"0:0"}, actors)
    assert_ledger_exact(job, steps)


def test_a_time_limit_signal_before_any_checkpoint_fails_instead_of_looping(slurm, config, tmp_path):
    """The time-limit USR1 at a start that has written no checkpoint yet (a time limit shorter than
    cluster.time_limit_grace_s): requeued, the job would start again from the same point and be signalled again,
    forever. It fails instead, with one line that says why and what to do, and is not requeued."""
    run_dir = tmp_path / "run"
    job = submitted(slurm, tmp_path, run_dir, *config, f"run.dir={run_dir}")
    # hub_address is written once the batch script listens for USR1, while the learner is still starting: no
    # update can be trained, so no checkpoint written, before the signal.
    wait_for("the job's hub_address", lambda: (run_dir / "hub_address").exists(), 180, job)
    slurm.run(["scancel", "--batch", "--signal=USR1", job.id])
    assert_ended_clean(job, "FAILED", None, job.actors("n2"))
    assert slurm.restarts(job.id) == 0 and not job.rows()
    out = (tmp_path / f"fleetrl-{job.id}.out").read_text()
    why = "no new checkpoint since this start (is the time limit longer than cluster.time_limit_grace_s?)"
    assert f"{why}: not requeueing; resubmit with --resume {run_dir}" in out, out[-2000:]


def rank_processes(job_id: str, rank: int) -> list[int]:
    """Pids of the job's learner worker of global rank `rank` (torchrun sets RANK in each worker's environment)."""
    return [pid for pid, env, _ in processes() if env.get("SLURM_JOB_ID") == job_id and env.get("RANK") == str(rank)]


def test_a_learner_crash_ends_the_job_promptly(slurm, config, tmp_path):
    """A learner group of two nodes (n1, n2; the actor on n3): it forms across the nodes through torchrun and
    trains. Then problem 7: learner rank 1 (on n2, not the batch host) is SIGKILLed. The job fails and stops its
    actors at once; before, it waited 60 s for actors that wait for a learner that cannot come back."""
    run_dir = tmp_path / "run"
    job = submitted(slurm, tmp_path, run_dir, *config, f"run.dir={run_dir}", "cluster.learner_nodes=2")
    wait_for("a trained step", lambda: job.rows(), 300, job)
    ready = job.learner("learner.ready")[-1]
    assert (ready["ranks"], ready["dp"]) == (2, 2)
    (pid,) = rank_processes(job.id, 1)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert slurm.wait_done(job.id, 60) == "FAILED"
    took = time.monotonic() - t0
    assert took < 20, took
    assert_ended_clean(job, "FAILED", None, job.actors("n3"))
    assert len(job.actors("n3")) == 1
    assert slurm.exit_codes(job.id)[0] != "0:0"
    # The job's output is the user's screen: the cause in one line (n2's launcher), and rank 0, whose collective
    # lost rank 1, says so in one line too (its traceback, 40 lines of two chained gloo errors, is in its log file).
    out = (tmp_path / f"fleetrl-{job.id}.out").read_text()
    assert "fleetrl learner: rank 1 died (signal SIGKILL) without an error" in out, out[-3000:]
    assert "Traceback" not in out, out[max(0, out.index("Traceback") - 500) :][:3000]
    assert "FutureWarning" not in out, out[max(0, out.index("FutureWarning") - 300) :][:1000]  # torch's, for DeepSpeed and vLLM


@pytest.mark.skipif(
    not os.environ.get("FLEETRL_SLURM_TIMER"), reason="Slurm's own time-limit signal takes minutes: FLEETRL_SLURM_TIMER=1 runs it"
)
def test_slurms_own_time_limit_signal_requeues_the_job(slurm, config, tmp_path):
    """What test_a_requeued_job_resumes_by_itself sends by hand, from Slurm's own timer: a job submitted with a
    3-minute limit gets USR1 cluster.time_limit_grace_s before it (submit.sh's --signal=B:USR1@100; Slurm sends
    it up to a minute early), checkpoints, requeues itself, and resumes from that checkpoint on its start again."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    job = submitted(
        slurm,
        tmp_path,
        run_dir,
        *config,
        f"run.dir={run_dir}",
        "train.total_steps=100000",
        "cluster.time_limit_grace_s=100",
        sbatch="--time=3",
    )
    try:
        stop = wait_for("the learner's checkpoint at the time-limit signal", lambda: job.learner("learner.done"), 240, job)[0]
        signalled_s = time.monotonic() - t0
        assert (run_dir / "checkpoints" / f"step-{stop['updates']}" / "state").exists()
        wait_for("the start again", lambda: slurm.restarts(job.id) == 1 and slurm.job_state(job.id) == "RUNNING", 180)
        resumed = wait_for("the resume", lambda: job.learner("learner.resumed_engines"), 180)
        assert resumed[0]["checkpoint"].endswith(f"step-{stop['updates']}")
        wait_for("training after the resume", lambda: len(job.rows()) >= stop["updates"] + 2, 180, job)
        out = "".join(p.read_text() for p in tmp_path.glob("*.out"))  # both starts' lines: --open-mode=append
        assert "the time limit is near: checkpointing, then requeueing" in out and "start 2 of job" in out, out[-2000:]
        rows = job.rows()
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        print(f"USR1 from Slurm's timer {signalled_s:.0f} s after submission (--time=3, grace 100 s); resumed at step {stop['updates']}")
    finally:
        slurm.run(["scancel", job.id], check=False)
        slurm.wait_done(job.id, 120)
