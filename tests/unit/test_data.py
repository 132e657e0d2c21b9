"""Prompt sets read through `datasets` (JSON, JSON Lines, Parquet, folders, hub ids), errors that say where,
prompts over the token budget dropped, and the held-out validation split."""

import dataclasses
import json
import tomllib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from structlog.testing import capture_logs

from deploy.tiny import build_tokenizer
from learner.data.prompts import addition_items, load_datasets, split_holdout
from learner.data.rows import FORMATS, read_rows
from learner.data.sources import count_rows
from protocol.config import DATA_FORMATS, ConfigError, dump_toml, load_config

ROWS = [{"q": f"{a}+{b}=", "a": a + b, "extra": "x"} for a in range(5) for b in range(4)]  # 20 rows, int answers
TOK = build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_json(path, rows):
    path.write_text(json.dumps(rows))
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def read(path, *overrides, field="data.path"):
    cfg = load_config(None, ["data.task=file", f"data.path={path}", *overrides])
    return read_rows(str(path), field, cfg.data, TOK, cfg.data.split)


def test_json_jsonl_parquet_and_a_folder_read_the_same_rows(tmp_path):
    keys = ("data.prompt_key=q", "data.answer_key=a")
    from_jsonl = read(write_jsonl(tmp_path / "p.jsonl", ROWS), *keys)
    from_json = read(write_json(tmp_path / "p.json", ROWS), *keys)  # one JSON array
    from_parquet = read(write_parquet(tmp_path / "p.parquet", ROWS), *keys)
    assert from_jsonl == from_json == from_parquet
    assert len(from_jsonl) == 20 and from_jsonl[7] == ("1+3=", "4", '{"extra": "x"}')  # numeric answers become text
    folder = tmp_path / "shards"
    (folder / "sub").mkdir(parents=True)
    write_parquet(folder / "a.parquet", ROWS[:8])
    write_jsonl(folder / "sub" / "b.jsonl", ROWS[8:])
    (folder / "README.md").write_text("not data")  # other files are not read
    assert read(folder, *keys) == from_jsonl  # sorted by path: a.parquet, then sub/b.jsonl
    assert count_rows(folder) == 20 and count_rows(tmp_path / "p.json") == 20 and count_rows(tmp_path / "p.jsonl") == 20


def test_errors_name_file_row_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    cases = [
        ([{"q": "1+1=", "a": 2}, {"q": "2+2=", "a": 4}, {"a": 3}], "row 2 (0-based): column 'q' is missing or null"),
        ([{"q": "1+1=", "a": 2}, {"q": 5, "a": 4}], "row 1 (0-based): column 'q' must be a string or a list of chat messages"),
        ([{"q": "", "a": 1}], "row 0 (0-based): column 'q' is empty"),
        ([{"q": "1+1=", "a": None}], "row 0 (0-based): column 'a' is missing or null"),
        ([{"q": "1+1=", "a": True}], "row 0 (0-based): column 'a' must be a string or number, got bool"),
        ([{"q": "1+1=", "a": {"x": 1}}], "row 0 (0-based): column 'a' must be a string or number, got dict"),
        ([{"q": [{"role": "user"}], "a": 1}], 'column \'q\', message 0: expected {"role": str, "content": str}'),
        ([{"q": [{"role": "assistant", "content": "2"}], "a": 2}], "column 'q' has no message before the assistant's reply"),
        ([{"x": "1+1=", "a": 2}], "no columns 'q' and 'a' for data.format = 'plain' (has: 'x', 'a')"),
    ]
    for rows, expected in cases:
        write_jsonl(path, rows)
        with pytest.raises(ConfigError) as err:
            read(path, "data.prompt_key=q", "data.answer_key=a")
        assert str(err.value).startswith(f"data.path: {path}: ") and expected in str(err.value), str(err.value)
    path.write_text('{"q": "1+1=", "a": 2}\n\n{"q": "2+2=", "a": \n')  # blank line skipped, line 3 broken
    with pytest.raises(ConfigError, match=r"bad.jsonl: line 3: not valid JSON"):
        read(path)
    path.write_bytes(b'\xff\xfe{"q": "1+1=", "a": 2}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl: not UTF-8 text"):
        read(path)
    path.write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"data.test_path: .*bad.jsonl: no rows"):
        read(path, field="data.test_path")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"junk.parquet: not readable as parquet \(ArrowInvalid: Parquet magic bytes"):
        read(tmp_path / "junk.parquet")
    with pytest.raises(ConfigError, match=r"p.csv: unknown extension '.csv' \(expected .json, .jsonl or .parquet\)"):
        (tmp_path / "p.csv").write_text("q,a\n")
        read(tmp_path / "p.csv")
    with pytest.raises(ConfigError, match=r"data.path: .*nope.jsonl not found"):
        read(tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty: a folder with no .json, .jsonl or .parquet files"):
        read(tmp_path / "empty")


def test_a_hub_id_without_network_fails_in_one_line():
    # conftest sets HF_HUB_OFFLINE=1: no network here, and the failure is immediate instead of after retries.
    with pytest.raises(ConfigError) as err:
        read("someone/some-math-set", "data.split=validation")
    text = str(err.value)
    assert "\n" not in text and text.startswith("data.path: 'someone/some-math-set' is not a local file or folder")
    assert "hub dataset someone/some-math-set, split 'validation' failed" in text and "Couldn't reach" in text


def test_prompts_over_the_budget_are_dropped_and_counted(tmp_path):
    rows = [{"prompt": "1" * n, "answer": "1"} for n in (5, 50, 10, 61, 60)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    # Budget: actor.max_model_len 64 - rollout.max_tokens 4 = 60 prompt tokens (one per character here).
    with capture_logs() as logs:
        data = load_datasets(load_config(None, ["data.task=file", f"data.path={path}", "rollout.max_tokens=4"]), TOK)
    assert [len(p.tokens) for p in data.train.items] == [5, 50, 10, 60] and data.train.dropped == 1
    too_long = [e for e in logs if e["event"] == "data.too_long"]
    assert len(too_long) == 1 and too_long[0]["dropped"] == {"train": 1} and too_long[0]["budget_tokens"] == 60
    assert any(e["event"] == "data.loaded" and e["train"] == 4 for e in logs)
    with pytest.raises(
        ConfigError, match=r"data.path: all 5 prompts are longer than 3 tokens, the budget data.max_prompt_tokens \(0: actor.max_model_len"
    ):
        load_datasets(load_config(None, ["data.task=file", f"data.path={path}", "actor.max_model_len=8", "rollout.max_tokens=5"]), TOK)


def test_long_prompts_are_truncated_to_max_prompt_tokens_or_dropped(tmp_path):
    """Open-Reasoner-Zero's shape: 2048-token prompts in an 8192 context with 8000 to generate (here 6 in 10 with 8):
    data.max_prompt_tokens admits prompts the default budget (max_model_len - max_tokens = 2) would drop, and
    data.long_prompts = truncate keeps a longer one's first tokens, its text decoded from them."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": "1"} for p in ("12", "1234", "12345678")])
    base = ["data.task=file", f"data.path={path}", "rollout.max_tokens=8", "actor.max_model_len=10"]
    default = load_datasets(load_config(None, base), TOK)
    assert [p.text for p in default.train.items] == ["12"] and default.train.dropped == 2
    dropped = load_datasets(load_config(None, [*base, "data.max_prompt_tokens=6"]), TOK)
    assert [p.text for p in dropped.train.items] == ["12", "1234"] and dropped.train.dropped == 1
    with capture_logs() as logs:
        cut = load_datasets(load_config(None, [*base, "data.max_prompt_tokens=6", "data.long_prompts=truncate"]), TOK)
    assert [p.text for p in cut.train.items] == ["12", "1234", "123456"]
    assert [len(p.tokens) for p in cut.train.items] == [2, 4, 6] and cut.train.truncated == 1 and cut.train.dropped == 0
    assert list(cut.train.items[2].tokens) == list(TOK("12345678", add_special_tokens=False)["input_ids"][:6])
    (warning,) = [e for e in logs if e["event"] == "data.too_long"]
    assert warning["truncated"] == {"train": 1} and warning["budget_tokens"] == 6
    with pytest.raises(ConfigError, match=r"^data.max_prompt_tokens: 10 leaves no room to generate in actor.max_model_len 10$"):
        load_config(None, [*base, "data.max_prompt_tokens=10"])
    with pytest.raises(ConfigError, match=r"^data.long_prompts: 'cut' must be drop or truncate$"):
        load_config(None, [*base, "data.long_prompts=cut"])


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
    test_file = write_parquet(tmp_path / "test.parquet", [{"prompt": "9+9=", "answer": "18"}, {"prompt": "8+9=", "answer": "17"}])
    cfg = load_config(None, ["data.val_fraction=0.25", f"data.test_path={test_file}", "run.seed=7"])
    data = load_datasets(cfg, TOK)
    assert data.val is not None and data.test is not None
    assert (len(data.train), len(data.val), len(data.test)) == (75, 25, 2)
    train_texts = {p.text for p in data.train.items}
    assert not train_texts & {p.text for p in data.val.items}
    assert [p.answer for p in data.test.items] == ["18", "17"]
    assert list(data.eval_sets()) == ["val", "test"]
    assert data.train[0].tokens.dtype.name == "int32" and len(data.train[0].tokens) == 4
    assert {p.text for p in load_datasets(cfg, TOK).val.items} == {p.text for p in data.val.items}  # reproducible

    rows = write_jsonl(tmp_path / "p.jsonl", ROWS)
    data = load_datasets(load_config(None, ["data.task=file", f"data.path={rows}", "data.prompt_key=q", "data.answer_key=a"]), TOK)
    assert len(data.train) == 20 and data.val is None and data.test is None and data.eval_sets() == {}
    assert data.train[0].metadata == '{"extra": "x"}'


def test_config_checks_the_data_fields():
    assert set(DATA_FORMATS) == set(FORMATS)  # the config's list and the loader's mappings agree
    for override, message in [
        ("data.format=alpaca", r"data.format: 'alpaca' must be one of plain, orz, verl, open_instruct"),
        ("data.prompt_template=Q: {question}", r"data.prompt_template: must contain \{prompt\}"),
        ('data.metadata_keys=["a", ""]', r"data.metadata_keys: an empty column name"),
        ("data.max_metadata_bytes=1", r"data.max_metadata_bytes: must be >= 2"),
        ("data.metadata_keys=a", r"data.metadata_keys: expected a list of str"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    cfg = load_config(None, ['data.metadata_keys=["dataset", "extra_info.index"]', "data.chat_template=true"])
    assert cfg.data.metadata_keys == ["dataset", "extra_info.index"] and cfg.data.chat_template
    # The run directory's config.toml keeps a template's newlines, quotes and backslashes (actors read it back).
    cfg.data.prompt_template = 'Q: {prompt}\n\tby the \\boxed{} "tag"\nA:'
    assert tomllib.loads(dump_toml(cfg))["data"] == dataclasses.asdict(cfg.data)


def test_config_keeps_checkpoints_on_eval_steps():
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps: 5 must be a multiple of eval.every_steps \(2\)"):
        load_config(None, ["eval.every_steps=2", "checkpoint.every_steps=5"])
    load_config(None, ["eval.every_steps=2", "checkpoint.every_steps=4"])
    load_config(None, ["eval.every_steps=2", "checkpoint.every_steps=5", "checkpoint.best_metric=reward_mean"])
    with pytest.raises(ConfigError, match=r"eval.timeout_s: must be > 0"):
        load_config(None, ["eval.timeout_s=0"])
