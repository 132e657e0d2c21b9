"""Prompt sets from JSONL and Parquet, errors that say where, and the held-out validation split."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deploy.tiny import build_tokenizer
from learner.data import addition_items, load_datasets, read_items, split_holdout
from protocol.config import ConfigError, load_config

ROWS = [{"q": f"{a}+{b}=", "a": a + b, "extra": "x"} for a in range(5) for b in range(4)]  # 20 rows, int answers


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_jsonl_and_parquet_read_the_same_items_with_configured_keys(tmp_path):
    from_jsonl = read_items(write_jsonl(tmp_path / "p.jsonl", ROWS), "q", "a", "data.path")
    from_parquet = read_items(write_parquet(tmp_path / "p.parquet", ROWS), "q", "a", "data.path")
    assert from_jsonl == from_parquet
    assert len(from_jsonl) == 20 and from_jsonl[7] == ("1+3=", "4")  # numeric answers become text


def test_jsonl_errors_name_file_line_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    cases = [
        ([{"q": "1+1=", "a": 2}, {"q": "2+2=", "a": 4}, {"a": 3}], "line 3: missing column 'q'"),
        ([{"q": "1+1=", "a": 2}, {"q": 5, "a": 4}], "line 2: column 'q' must be a string, got int"),
        ([{"q": "1+1="}], "line 1: missing column 'a'"),
        ([{"q": "", "a": 1}], "line 1: column 'q' is empty"),
        ([{"q": "1+1=", "a": None}], "line 1: column 'a' must be a string or number, got NoneType"),
        ([[1, 2]], "line 1: expected an object"),
    ]
    for rows, expected in cases:
        write_jsonl(path, rows)
        with pytest.raises(ConfigError) as err:
            read_items(str(path), "q", "a", "data.path")
        assert str(err.value).startswith(f"data.path: {path}: ") and expected in str(err.value), str(err.value)
    path.write_text('{"q": "1+1=", "a": 2}\n\n{"q": "2+2=", "a": \n')  # blank line skipped, line 3 broken
    with pytest.raises(ConfigError, match=r"line 3: not valid JSON"):
        read_items(str(path), "q", "a", "data.path")
    path.write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"data.test_path: .*bad.jsonl: no rows"):
        read_items(str(path), "q", "a", "data.test_path")


def test_parquet_errors_name_row_and_column(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"q": "1+1=", "a": "2"}, {"q": None, "a": "3"}])
    with pytest.raises(ConfigError, match=r"p.parquet: row 1 \(0-based\): column 'q' must be a string, got NoneType"):
        read_items(path, "q", "a", "data.path")
    with pytest.raises(ConfigError, match=r"missing column 'prompt' \(has: 'q', 'a'\)"):
        read_items(path, "prompt", "a", "data.path")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"junk.parquet: not a readable Parquet file"):
        read_items(str(tmp_path / "junk.parquet"), "q", "a", "data.path")
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"q": pa.array([], pa.string()), "a": pa.array([], pa.string())}), empty)
    with pytest.raises(ConfigError, match=r"empty.parquet: no rows"):
        read_items(empty, "q", "a", "data.path")


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path: .*p.csv: unknown extension '.csv' \(expected .jsonl or .parquet\)"):
        read_items(str(tmp_path / "p.csv"), "q", "a", "data.path")
    with pytest.raises(ConfigError, match=r"data.test_path: .*nope.jsonl not found"):
        read_items(str(tmp_path / "nope.jsonl"), "q", "a", "data.test_path")


def test_split_is_deterministic_disjoint_and_sized():
    items = addition_items()  # 100 distinct prompts
    train, val = split_holdout(items, 0.2, seed=3)
    assert len(val) == 20 and len(train) == 80
    assert not {t for t, _ in train} & {t for t, _ in val}
    assert sorted(train + val) == sorted(items)
    assert split_holdout(items, 0.2, seed=3) == (train, val)  # same seed: same split
    assert split_holdout(items, 0.2, seed=4)[1] != val  # another seed: another split
    assert split_holdout(items, 0.0, seed=3) == (items, [])
    assert len(split_holdout(items, 0.001, seed=3)[1]) == 1  # a nonzero fraction holds out at least one
    # The same prompt text twice never straddles the split.
    train, val = split_holdout(items * 3, 0.3, seed=0)  # every prompt three times
    assert (len(train), len(val), len({t for t, _ in val})) == (210, 90, 30)
    assert not {t for t, _ in train} & {t for t, _ in val}
    with pytest.raises(ConfigError, match=r"data.val_fraction: 0.9 of 2 distinct prompts holds out 2"):
        split_holdout([("1+1=", "2"), ("1+2=", "3")], 0.9, seed=0)


def test_load_datasets_trains_only_on_the_training_split(tmp_path):
    tok = build_tokenizer()
    test_file = write_parquet(tmp_path / "test.parquet", [{"prompt": "9+9=", "answer": "18"}, {"prompt": "8+9=", "answer": "17"}])
    cfg = load_config(None, ["data.val_fraction=0.25", f"data.test_path={test_file}", "run.seed=7"])
    data = load_datasets(cfg, tok)
    assert data.val is not None and data.test is not None
    assert (len(data.train), len(data.val), len(data.test)) == (75, 25, 2)
    train_texts = {p.text for p in data.train.items}
    assert not train_texts & {p.text for p in data.val.items}
    assert [p.answer for p in data.test.items] == ["18", "17"]
    assert list(data.eval_sets()) == ["val", "test"]
    assert data.train[0].tokens.dtype.name == "int32" and len(data.train[0].tokens) == 4
    assert {p.text for p in load_datasets(cfg, tok).val.items} == {p.text for p in data.val.items}  # reproducible

    rows = write_jsonl(tmp_path / "p.jsonl", ROWS)
    data = load_datasets(load_config(None, ["data.task=file", f"data.path={rows}", "data.prompt_key=q", "data.answer_key=a"]), tok)
    assert len(data.train) == 20 and data.val is None and data.test is None and data.eval_sets() == {}


def test_config_keeps_checkpoints_on_eval_steps():
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps: 5 must be a multiple of eval.every_steps \(2\)"):
        load_config(None, ["eval.every_steps=2", "checkpoint.every_steps=5"])
    load_config(None, ["eval.every_steps=2", "checkpoint.every_steps=4"])
    load_config(None, ["eval.every_steps=2", "checkpoint.every_steps=5", "checkpoint.best_metric=reward_mean"])
    with pytest.raises(ConfigError, match=r"eval.timeout_s: must be > 0"):
        load_config(None, ["eval.timeout_s=0"])
