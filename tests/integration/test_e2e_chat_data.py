"""The full loop from a chat-format dataset: `fleetrl demo` (a learner and a vLLM actor) trains the demo model
from a verl-style Parquet file (chat-list prompts, the answer under reward_model.ground_truth), rendered by a
chat template of the model's tokenizer, and evaluates a JSON Lines test set of string prompts rendered by
data.prompt_template. The reward records what it was given: rendered prompts, nested answers and the rows'
metadata must reach it, in training and in evaluation."""

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocol.net import free_port

pytestmark = pytest.mark.engine
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The turns' text, then "=" for the reply: "3+4" renders as "3+4=", the demo's own prompt, within its alphabet.
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def test_trains_from_chat_parquet_with_nested_answers(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    model = tmp_path / "model"  # the demo model with a chat template (the demo tokenizer has none)
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = CHAT
    tok.save_pretrained(model)
    train = [
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": 10 * a + b},
        }
        for a in range(10)
        for b in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(train), tmp_path / "train.parquet")
    test = [{"data_source": "arith-test", "prompt": f"{a}+{a}", "reward_model": {"ground_truth": str(2 * a)}} for a in range(5)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))

    steps, prompts, n = 3, 4, 4
    run_dir, seen = tmp_path / "run", tmp_path / "reward_calls.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "demo",
        f"run.dir={run_dir}",
        "demo.num_actors=1",
        f"model.path={model}",
        "data.task=file",
        f"data.path={tmp_path / 'train.parquet'}",
        "data.format=verl",
        f"data.test_path={tmp_path / 'test.jsonl'}",
        "data.prompt_template={prompt}=",
        "rollout.reward_fn=tests.chat_reward:exact_match_logged",
        f"train.total_steps={steps}",
        f"train.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={n}",
        "train.micro_batch_samples=16",
        f"hub.bind=tcp://127.0.0.1:{free_port()}",
        f"eval.every_steps={steps}",
        "eval.greedy=true",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=420, env={**os.environ, "FLEETRL_TEST_REWARD_LOG": str(seen)}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["samples"] == prompts * n for r in rows)
    assert rows[-1]["eval/test/prompts"] == 5 and 0 <= rows[-1]["eval/test/reward_mean"] <= 1
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    train_calls = [c for c in calls if c["metadata"].get("data_source") == "arith"]
    test_calls = [c for c in calls if c["metadata"].get("data_source") == "arith-test"]
    assert len(train_calls) >= steps * prompts * n and len(test_calls) == 5 and len(calls) == len(train_calls) + 5
    for c in train_calls:  # chat template applied; answer from reward_model.ground_truth; the other columns as metadata
        a, b = divmod(c["metadata"]["extra_info"]["index"], 10)
        assert c["prompt"] == f"{a}+{b}=" and c["answer"] == str(a + b)
        assert set(c["metadata"]) == {"data_source", "extra_info"}  # the prompt and answer columns are not metadata
    assert sorted(c["prompt"] for c in test_calls) == [f"{a}+{a}=" for a in range(5)]  # data.prompt_template
    assert all(c["answer"] == str(2 * int(c["prompt"][0])) for c in test_calls)
