"""deploy/submit.py's sbatch options from the config, and deploy/restart.py's answer to a restarted job (no Slurm
needed: the real submissions, requeues and restarts are in tests/slurm)."""

from pathlib import Path

import pytest

from deploy.restart import JOB_FILE, resume_from
from deploy.submit import components, parse_gres
from protocol.config import ConfigError, load_config


def test_cpu_fleet_asks_for_no_gpu_and_requeues_before_its_time_limit():
    learner, actors = components(load_config(None, ["actor.device=cpu", "cluster.actor_nodes=2"]))
    # the signal goes to the batch script's component, whose output a start again appends to
    assert learner == ["--nodes=1", "--signal=B:USR1@300", "--requeue", "--open-mode=append"]
    assert actors == ["--nodes=2", "--requeue"]


def test_gpu_fleet_asks_each_component_for_its_gpus():
    learner, actors = components(load_config(None, ["cluster.learner_gpus_per_node=8", "cluster.actor_gpus_per_node=4"]))
    assert learner[:2] == ["--nodes=1", "--gpus-per-node=8"] and actors == ["--nodes=1", "--gpus-per-node=4", "--requeue"]


def test_grace_zero_sends_no_signal_and_a_bad_grace_is_one_line():
    learner, _ = components(load_config(None, ["actor.device=cpu", "cluster.time_limit_grace_s=0"]))
    assert learner == ["--nodes=1", "--requeue", "--open-mode=append"]
    with pytest.raises(ConfigError, match=r"cluster.time_limit_grace_s: must be 0 \(off\) to 65535"):
        load_config(None, ["cluster.time_limit_grace_s=70000"])


def test_gres_counts_gpus():
    assert parse_gres("gpu:8") == 8 and parse_gres("gpu:a100:4(S:0-1)") == 4 and parse_gres("gpu:2,shard:8") == 2
    assert parse_gres("(null)") == 0


def test_a_restarted_job_resumes_only_its_own_run_and_only_from_a_checkpoint(tmp_path: Path):
    checkpoint = tmp_path / "checkpoints" / "step-4"
    found, why = resume_from(tmp_path, "17", checkpoint)
    assert found is None and "job unknown's run, not job 17's" in why  # no job file: not known to be this job's
    (tmp_path / JOB_FILE).write_text("16\n")
    found, why = resume_from(tmp_path, "17", checkpoint)
    assert found is None and "job 16's run" in why  # another job's run directory is not taken over
    (tmp_path / JOB_FILE).write_text("17\n")
    assert resume_from(tmp_path, "17", checkpoint) == (checkpoint, "")
    found, why = resume_from(tmp_path, "17", None)
    assert found is None and "starts again from step 0" in why


def test_the_restart_question_is_answered_without_torch(tmp_path: Path):
    """fleet.sbatch asks `deploy.restart newest` at every start: it must not pay torch's import (seconds)."""
    import subprocess
    import sys

    step = tmp_path / "checkpoints" / "step-3" / "state"
    step.mkdir(parents=True)
    (step / "learner.json").write_text("{}")
    (tmp_path / "checkpoints" / "step-5").mkdir()  # weights only: not one to resume from
    code = "import sys, deploy.restart as r; rc = r.main(['newest', sys.argv[1]]); print('torch' in sys.modules); sys.exit(rc)"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert out.stdout.split() == [str(tmp_path / "checkpoints" / "step-3"), "False"], out
