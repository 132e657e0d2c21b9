"""One short run with everything real: `fleetrl demo` starts a learner and an actor process
(vLLM engine, ZeroMQ sockets, DeepSpeed, gloo weight group) and trains a few steps, with the
actor evaluating the held-out prompts greedily every 3 steps and Hugging Face checkpoints."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from protocol.net import free_port

pytestmark = pytest.mark.engine
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_short_run_trains_and_advances_versions(tmp_path, tiny_model_dir):
    steps, prompts, n, k, every = 6, 8, 4, 1, 3
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "demo",
        f"run.dir={run_dir}",
        "demo.num_actors=1",
        f"train.total_steps={steps}",
        f"train.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={n}",
        f"staleness.max_staleness={k}",
        f"hub.bind=tcp://127.0.0.1:{free_port()}",
        f"model.path={tiny_model_dir}",
        "train.micro_batch_samples=16",
        "data.val_fraction=0.2",
        f"eval.every_steps={every}",
        "eval.greedy=true",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep=1",
        f"log.samples_every_steps={every}",
    ]
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
    # What the actors generated: lengths within rollout.max_tokens, truncation, reward errors (none for exact_match).
    assert all(1 <= r["response/length_mean"] <= r["response/length_max"] <= 4 for r in rows)
    assert all(0 <= r["response/truncation_rate"] <= 1 and r["reward/errors"] == 0 for r in rows)
    step_lines = [e for e in learner_log if e["event"] == "learner.step"]
    assert [(e["step"], e["steps_total"]) for e in step_lines] == [(s, steps) for s in range(1, steps + 1)]
    assert step_lines[0]["eta_s"] is None and all(e["eta_s"] >= 0 for e in step_lines[1:]) and step_lines[-1]["eta_s"] == 0
    # Sample completions every 3 steps, decoded by the learner: each reward is exact_match of its text.
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [3, 3, 6, 6]
    for x in samples:
        assert x["prompt"].endswith("=") and len(x["completions"]) == n
        for c in x["completions"]:
            # The learner writes special tokens as text; the reward saw vLLM's text, without them (a sampled <pad>)
            assert c["reward"] == float(re.sub(r"<(pad|eos|bos)>", "", c["text"]).strip() == x["answer"]), x
            assert c["finish_reason"] == ("stop" if c["text"].endswith("<eos>") else "length") and 1 <= c["tokens"] <= 4
    actor_log = [json.loads(x) for x in (run_dir / "logs" / "actor-actor0.jsonl").read_text().splitlines()]
    assert any(e["event"] == "actor.registered" for e in actor_log) and all(e["actor_id"] == "actor0" for e in actor_log)

    # Evaluation: the actor answered every validation prompt greedily, for the version the row names.
    evals = {r["step"]: r for r in rows if "eval/val/reward_mean" in r}
    assert sorted(evals) == [3, 6]
    for step, r in evals.items():
        assert r["eval/policy_version"] == step and r["eval/partial"] == 0 and r["eval/val/prompts"] == 20
        assert 0 <= r["eval/val/reward_mean"] <= 1
    assert rows[-1]["hub/eval_granted"] == 40  # 20 prompts x 2 rounds, none lost or re-granted
    # Checkpoints: step-6 (newest, keep = 1) plus the best; best.json names the better of the two.
    ckpt_dir = run_dir / "checkpoints"
    best = json.loads((ckpt_dir / "best.json").read_text())
    scores = {s: evals[s]["eval/val/reward_mean"] for s in (3, 6)}
    assert best["step"] == (6 if scores[6] > scores[3] else 3) and best["value"] == scores[best["step"]]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == sorted({"best.json", "step-6", f"step-{best['step']}"})
    # The checkpoint reloads with transformers, and its greedy answers score what the vLLM actor measured.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.data.prompts import addition_items, split_holdout

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir / "step-6", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters(), strict=True))  # trained weights
    tok = AutoTokenizer.from_pretrained(ckpt_dir / "step-6")
    _, val = split_holdout(addition_items(), 0.2, seed=0)
    right = 0
    for text, answer in val:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        right += tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == answer
    assert right / len(val) == pytest.approx(scores[6], abs=1e-6), (right, scores)  # the metric travels as float32


def test_two_learner_ranks_zero3_with_mini_batches(tmp_path, tiny_model_dir):
    """The learner group as a lab runs it, small: `fleetrl learner` starts 2 ranks itself (torchrun), ZeRO-3
    shards the weights, each update takes 2 optimizer steps, and the weights the actor receives are the
    gathered ZeRO-3 ones: its logprobs must still match the learner's."""
    updates, prompts, n = 4, 4, 4
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "demo",
        f"run.dir={run_dir}",
        "demo.num_actors=1",
        f"train.total_steps={updates}",
        f"train.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={n}",
        "staleness.max_staleness=1",
        f"hub.bind=tcp://127.0.0.1:{free_port()}",
        f"model.path={tiny_model_dir}",
        "train.micro_batch_samples=4",
        "train.mini_batches=2",
        "train.zero_stage=3",
        "cluster.learner_gpus_per_node=2",
        "checkpoint.every_steps=2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in rows] == [2, 4, 6, 8]  # versions count optimizer steps: 2 per update
    assert all(r["samples"] == prompts * n and r["staleness_max"] <= 0 for r in rows)  # k = S - 1 = 1: on-policy batches
    mismatches = [r["logprob_mismatch"] for r in rows if r["logprob_mismatch"] is not None]
    assert mismatches and max(mismatches) < 1e-4, mismatches  # gathered ZeRO-3 weights reached the engine intact
    rank1 = [json.loads(x) for x in (run_dir / "logs" / "learner-rank1.jsonl").read_text().splitlines()]
    assert any(e["event"] == "learner.done" and e["updates"] == updates for e in rank1)
    # The checkpoint, written from the gathered snapshot, holds the full trained weights.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-4", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert all(a.shape == b.shape for a, b in zip(model.parameters(), start.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters(), strict=True))
