"""One short run with everything real: `fleetrl demo` starts a learner and an actor process
(vLLM engine, ZeroMQ sockets, DeepSpeed, gloo weight group) and trains a few steps."""

import json
import os
import subprocess
import sys

import pytest

from protocol.net import free_port

pytestmark = pytest.mark.engine
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_short_run_trains_and_advances_versions(tmp_path, tiny_model_dir):
    steps, prompts, n, k = 6, 8, 4, 1
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "deploy.cli", "demo", f"run.dir={run_dir}", "demo.num_actors=1", f"train.total_steps={steps}",
           f"train.prompts_per_step={prompts}", f"rollout.samples_per_prompt={n}", f"staleness.max_staleness={k}",
           f"hub.bind=tcp://127.0.0.1:{free_port()}", f"model.path={tiny_model_dir}", "train.micro_batch_samples=16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["samples"] == prompts * n for r in rows)
    assert all(r["staleness_max"] <= k for r in rows)
    for key in ("reward_mean", "samples", "staleness_max", "logprob_mismatch", "tokens_per_s", "wall_s"):
        assert key in rows[0]
    mismatches = [r["logprob_mismatch"] for r in rows if r["logprob_mismatch"] is not None]
    assert mismatches and max(mismatches) < 1e-4, mismatches  # on-policy samples: engine == learner
    assert rows[-1]["ledger/trained"] == steps * prompts
    assert rows[-1]["weights/members"] == 1  # the actor was in the weight group at every sync
    assert all("time/weight_guard_wait" in r for r in rows)  # guarded: broadcast from ZeRO's flat parameters in place
    assert (run_dir / "config.toml").exists() and (run_dir / "reward_curve.png").exists()
    learner_log = [json.loads(x) for x in (run_dir / "logs" / "learner.jsonl").read_text().splitlines()]
    assert all("role" in e and "policy_version" in e for e in learner_log)
    actor_log = [json.loads(x) for x in (run_dir / "logs" / "actor-actor0.jsonl").read_text().splitlines()]
    assert any(e["event"] == "actor.registered" for e in actor_log) and all(e["actor_id"] == "actor0" for e in actor_log)
