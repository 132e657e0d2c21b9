"""The tool demo, short: `fleetrl demo --config configs/demo_tools.toml` with everything real (a vLLM engine per
actor, the calculator environment, ZeroMQ, DeepSpeed, the gloo weight group) for a few updates.

What it proves end to end: episodes of several turns reach the learner with their observation tokens masked, the
learner's logprobs of the model's tokens equal the engine's on on-policy samples (token-exact across turns, no
re-tokenization), the ledger trains every prompt once, the env/* metrics and samples.jsonl show the episodes.
That the demo learns (reward up by 0.3 or more) is bench/tool_demo.py's figure, a longer run."""

import json
import subprocess
import sys

import pytest
from test_e2e import ROOT

from actors.env.demo import calc
from protocol.net import free_port

pytestmark = pytest.mark.engine


def test_tool_demo_trains_episodes_token_exact(tmp_path):
    steps, prompts, n = 6, 8, 4
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "demo",
        "--config",
        "configs/demo_tools.toml",
        f"run.dir={run_dir}",
        "demo.num_actors=1",
        f"train.total_steps={steps}",
        f"train.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={n}",
        "train.micro_batch_samples=32",
        "staleness.max_staleness=1",
        f"hub.bind=tcp://127.0.0.1:{free_port()}",
        "log.samples_every_steps=3",
        "data.val_fraction=0.002",  # 8 held-out sums, evaluated greedily as episodes every 3 updates
        "eval.every_steps=3",
        "demo.warmstart_steps=60",  # a shorter warm start than the demo's (built once, cached): it calls the tool less
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and rows[-1]["ledger/trained"] == steps * prompts
    mismatches = [r["logprob_mismatch"] for r in rows if r["logprob_mismatch"] is not None]
    assert mismatches and max(mismatches) < 1e-4, mismatches  # on-policy episodes: engine == learner on model tokens
    assert all(1 <= r["env/turns_mean"] <= 3 and r["env/errors"] == 0 for r in rows)
    calls = sum(r["env/tool_use_share"] for r in rows)
    assert calls > 0 and any(r["env/obs_token_share"] > 0 for r in rows)  # the warm-started model calls the tool
    evals = [r for r in rows if "eval/val/reward_mean" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval/val/prompts"] == 8 and r["eval/partial"] == 0 for r in evals)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    episodes = [c for x in samples for c in x["completions"]]
    assert episodes and all(c["turns"][0]["role"] == "model" for c in episodes)
    for x in samples:
        for c in x["completions"]:
            last = c["turns"][-1]["text"].replace("<eos>", "")
            assert c["reward"] == float(last == x["answer"] and c["turns"][-1]["role"] == "model"), c
            if c["tool_calls"] and c["turns"][1]["text"].startswith("<result>"):  # the environment ran the model's call
                expression = c["turns"][0]["text"].removeprefix("<calc>").removesuffix("</calc>")
                assert c["turns"][1] == {"role": "env", "text": f"<result>{calc(expression)}</result>"}, c
