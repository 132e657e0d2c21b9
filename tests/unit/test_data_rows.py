"""The seed datasets' shapes (ORZ's JSON, verl/SimpleRL's Parquet, open-instruct's rows) load as shipped
(learner/data/rows.py); prompts render through a prompt template or the tokenizer's chat template; dotted keys
reach nested columns; the row's other columns become a bounded JSON object. That it reaches the actor, in work and
eval grants, over the real hub: tests/integration/test_data_formats.py."""

import datetime
import decimal
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deploy.tiny import build_tokenizer
from learner.data.rows import _MISSING, Row, lookup, plain, read_rows
from protocol.config import ConfigError, load_config

# System turns in brackets, then the turns' text, then "=" for the reply: every rendering stays in the demo alphabet.
CHAT = (
    "{% for m in messages %}{% if m['role'] == 'system' %}({{ m['content'] }}){% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHAT
    return tok


def read(path, *overrides, tok=None, field="data.path"):
    cfg = load_config(None, ["data.task=file", f"data.path={path}", *overrides])
    return read_rows(str(path), field, cfg.data, tok or chat_tokenizer(), cfg.data.split)


def test_orz_training_pairs_and_eval_files_get_orz_prompt(tmp_path):
    train = tmp_path / "orz_math_57k_collected.json"
    train.write_text(
        json.dumps(
            [
                [{"from": "human", "value": "What is $1+1$?"}, {"from": "assistant", "ground_truth": {"value": "2"}}],
                [{"from": "human", "value": "Solve $x^2=4$, x>0."}, {"from": "assistant", "ground_truth": {"value": "2"}}],
            ],
            indent=1,
        )
    )
    rows = read(train, "data.format=orz")
    head = (
        "<bos>A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
        "The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
        "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> "
        "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>. User: "
        "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And your "
        "final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
    )
    assert rows == [
        Row(head + "What is $1+1$?\nAssistant: <think>", "2", "{}"),
        Row(head + "Solve $x^2=4$, x>0.\nAssistant: <think>", "2", "{}"),
    ]
    evals = tmp_path / "math500.jsonl"  # ORZ's eval files: a one-turn prompt, final_answer, file_name
    evals.write_text(json.dumps({"prompt": [{"from": "human", "value": "1+2?"}], "final_answer": "3", "file_name": "math500"}) + "\n")
    assert read(evals, "data.format=orz") == [Row(head + "1+2?\nAssistant: <think>", "3", '{"file_name": "math500"}')]
    with pytest.raises(
        ConfigError,
        match=r"no columns '0.value' and '1.ground_truth.value' or 'prompt.0.value' and "
        r"'final_answer' for data.format = 'orz' \(has: 'prompt', 'answer'\)",
    ):
        (tmp_path / "plain.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
        read(tmp_path / "plain.jsonl", "data.format=orz")


def test_verl_parquet_chat_prompt_nested_answer_and_metadata(tmp_path):
    path = tmp_path / "train.parquet"
    rows = [
        {
            "data_source": "simplelr",
            "ability": "math",
            "prompt": [{"role": "system", "content": "9"}, {"role": "user", "content": f"1+{i}"}],
            "reward_model": {"style": "rule", "ground_truth": str(1 + i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    out = read(path, "data.format=verl")
    assert [r.text for r in out] == ["(9)1+0=", "(9)1+1=", "(9)1+2="]  # the tokenizer's chat template
    assert [r.answer for r in out] == ["1", "2", "3"]  # reward_model.ground_truth
    assert json.loads(out[2].metadata) == {"data_source": "simplelr", "ability": "math", "extra_info": {"split": "train", "index": 2}}
    # The same rows as plain keys: the dotted answer key, and metadata narrowed to what the reward needs.
    narrow = read(path, "data.answer_key=reward_model.ground_truth", 'data.metadata_keys=["data_source", "extra_info.index"]')
    assert [(r.text, r.answer) for r in narrow] == [(r.text, r.answer) for r in out]
    assert json.loads(narrow[1].metadata) == {"data_source": "simplelr", "extra_info.index": 1}
    with pytest.raises(
        ConfigError,
        match=r"train.parquet: row 0 \(0-based\): column 'prompt' holds chat messages, and the "
        r"tokenizer at model.path has no chat template",
    ):
        read(path, "data.format=verl", tok=build_tokenizer())


def test_open_instruct_messages_ground_truth_and_dataset(tmp_path):
    path = tmp_path / "rlvr.jsonl"
    path.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
                    "ground_truth": "4",
                    "dataset": "gsm8k",
                    "constraint": None,
                },
                {"messages": [{"role": "user", "content": "3*3"}], "ground_truth": "9", "dataset": "MATH", "constraint": None},
            ]
        )
    )
    out = read(path, "data.format=open_instruct")
    assert out == [
        Row("2+2=", "4", '{"dataset": "gsm8k", "constraint": null}'),  # the assistant's reply is not prompt
        Row("3*3=", "9", '{"dataset": "MATH", "constraint": null}'),
    ]
    lists = tmp_path / "rlvr_lists.jsonl"  # newer open-instruct sets keep one ground truth in a list
    lists.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"}], "ground_truth": ["2"], "dataset": ["gsm8k"]}) + "\n")
    assert read(lists, "data.format=open_instruct")[0][:2] == ("1+1=", "2")


def test_prompt_template_and_chat_template_for_string_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2", "answer": "3"}\n')
    assert read(path)[0].text == "1+2"  # plain: "{prompt}"
    assert read(path, "data.prompt_template={prompt}=")[0].text == "1+2="
    assert read(path, "data.prompt_template={bos_token}{prompt}=")[0].text == "<bos>1+2="
    assert read(path, "data.chat_template=true")[0].text == "1+2="  # a user turn through the chat template
    assert read(path, "data.chat_template=true", "data.prompt_template=({prompt})")[0].text == "(1+2)="  # template first
    from learner.data.prompts import load_datasets

    cfg = load_config(None, ["data.task=file", f"data.path={path}", "data.chat_template=true"])
    with pytest.raises(ConfigError, match=r"^data.chat_template: the tokenizer at model.path has no chat template"):
        load_datasets(cfg, build_tokenizer())


def test_dotted_keys_reach_nested_columns():
    row = {"a.b": 1, "a": {"b": 2, "c": [{"d": "x"}]}, "p": [{"value": "q"}]}
    assert lookup(row, "a.b") == 1  # a column literally named "a.b" wins
    assert lookup(row, "a.c.0.d") == "x" and lookup(row, "p.0.value") == "q"
    assert lookup(row, "a.c.1.d") is _MISSING and lookup(row, "a.zz") is _MISSING and lookup(row, "p.x") is _MISSING


def test_metadata_is_json_and_bounded(tmp_path):
    assert plain(
        {
            "i": np.int64(3),
            "f": np.float32(0.5),
            "nan": math.nan,
            "inf": -math.inf,
            "b": b"\x00\x01",
            "t": datetime.datetime(2025, 1, 2, 3, 4, 5),
            "d": decimal.Decimal("1.10"),
            "arr": np.arange(2),
            "nested": ({"x": np.bool_(True)},),
        }
    ) == {
        "i": 3,
        "f": 0.5,
        "nan": None,
        "inf": None,
        "b": "AAE=",
        "t": "2025-01-02T03:04:05",
        "d": "1.10",
        "arr": [0, 1],
        "nested": [{"x": True}],
    }
    path = tmp_path / "p.parquet"
    table = pa.table(
        {
            "prompt": ["1+1=", "2+2="],
            "answer": ["2", "4"],
            "when": pa.array([datetime.date(2025, 1, 1)] * 2),
            "blob": pa.array([b"ab", b"c" * 300], pa.binary()),
            "score": [math.nan, 1.5],
        }
    )
    pq.write_table(table, path)
    out = read(path)
    assert json.loads(out[0].metadata) == {"when": "2025-01-01", "blob": "YWI=", "score": None}
    with pytest.raises(
        ConfigError,
        match=r"p.parquet: row 1 \(0-based\): its metadata is \d+ bytes of JSON, over "
        r"data.max_metadata_bytes \(300\); column 'blob' alone is 402\. .*data.metadata_keys",
    ):
        read(path, "data.max_metadata_bytes=300")
    assert [r.metadata for r in read(path, "data.max_metadata_bytes=300", 'data.metadata_keys=["when"]')] == ['{"when": "2025-01-01"}'] * 2
    with pytest.raises(ConfigError, match=r"data.metadata_keys names 'nope', not a column here"):
        read(path, 'data.metadata_keys=["nope"]')
