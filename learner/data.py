"""Prompt sets: the built-in addition task, or local JSONL / Parquet files of prompts with answers.

    data.path --read--> rows --split by data.val_fraction (seeded, by prompt text)--> train | val
    data.test_path --read--> test

Only the training split becomes the ledger's PromptSet; the validation and test
sets are evaluated by the actors and never trained on. The split goes by distinct
prompt text, so a prompt repeated in the file cannot sit on both sides.
Errors name the file and the line (JSONL, 1-based) or row (Parquet, 0-based) and column.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocol.config import Config, ConfigError

Item = tuple[str, str]  # (prompt text, reference answer)


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    answer: str
    tokens: np.ndarray  # int32 [prompt_len]


class PromptSet:
    def __init__(self, items: list[Item], tokenizer, name: str = "data"):
        if not items:
            raise ConfigError(f"{name}: the prompt set is empty")
        self.items = []
        for i, (text, answer) in enumerate(items):
            tokens = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
            if tokens.shape[0] == 0:
                raise ConfigError(f"{name}: prompt {i} ({text[:40]!r}) tokenizes to no tokens")
            self.items.append(Prompt(text, answer, tokens))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prompt:
        return self.items[i]


@dataclass(kw_only=True, slots=True)
class Datasets:
    train: PromptSet  # the ledger's prompts: the only ones trained on
    val: PromptSet | None  # held out from data.path by data.val_fraction; None when 0
    test: PromptSet | None  # data.test_path; None when unset

    def eval_sets(self) -> dict[str, PromptSet]:
        """The sets the actors evaluate, by split name (the metric namespace eval/<name>/...)."""
        return {name: s for name, s in (("val", self.val), ("test", self.test)) if s is not None}


def addition_items(max_operand: int = 9) -> list[Item]:
    """'a+b=' -> 'a+b' for single digits: 100 prompts, answers of one or two characters."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def _item(row: Any, where: str, prompt_key: str, answer_key: str) -> Item:
    """One row -> (prompt, answer); ConfigError saying where and which column is wrong."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected an object with {prompt_key!r} and {answer_key!r}, got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if key not in row:
            raise ConfigError(f"{where}: missing column {key!r} (has: {', '.join(map(repr, row)) or 'nothing'})")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        raise ConfigError(f"{where}: column {prompt_key!r} must be a string, got {type(prompt).__name__} {prompt!r:.40}")
    if not prompt:
        raise ConfigError(f"{where}: column {prompt_key!r} is empty")
    # Numeric answers are common in math sets ("answer": 42); they are compared as text.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ConfigError(f"{where}: column {answer_key!r} must be a string or number, got {type(answer).__name__} {answer!r:.40}")
    return prompt, str(answer)


def read_jsonl(path: Path, prompt_key: str, answer_key: str, field: str) -> list[Item]:
    items = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{field}: {path}: line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e})") from e
            items.append(_item(row, where, prompt_key, answer_key))
    return items


def read_parquet(path: Path, prompt_key: str, answer_key: str, field: str) -> list[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except pa.ArrowInvalid as e:
        raise ConfigError(f"{field}: {path}: not a readable Parquet file ({e})") from e
    for key in (prompt_key, answer_key):
        if key not in schema.names:
            raise ConfigError(f"{field}: {path}: missing column {key!r} (has: {', '.join(map(repr, schema.names))})")
    table = pq.read_table(path, columns=[prompt_key, answer_key])
    prompts, answers = table.column(prompt_key).to_pylist(), table.column(answer_key).to_pylist()
    return [
        _item({prompt_key: p, answer_key: a}, f"{field}: {path}: row {i} (0-based)", prompt_key, answer_key)
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]


READERS = {".jsonl": read_jsonl, ".parquet": read_parquet}


def read_items(path: str, prompt_key: str, answer_key: str, field: str) -> list[Item]:
    """A prompt file by extension; `field` (data.path, data.test_path) prefixes every error."""
    p = Path(path)
    reader = READERS.get(p.suffix.lower())
    if reader is None:
        raise ConfigError(f"{field}: {path}: unknown extension {p.suffix!r} (expected {' or '.join(READERS)})")
    if not p.is_file():
        raise ConfigError(f"{field}: {path} not found")
    items = reader(p, prompt_key, answer_key, field)
    if not items:
        raise ConfigError(f"{field}: {path}: no rows")
    return items


def split_holdout(items: list[Item], fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """(train, held out): `fraction` of the distinct prompt texts, chosen by `seed`; file order kept on each side."""
    if fraction == 0:
        return items, []
    texts = list(dict.fromkeys(text for text, _ in items))
    n_out = max(1, round(fraction * len(texts)))  # a nonzero fraction asks for at least one prompt
    if n_out >= len(texts):
        raise ConfigError(
            f"data.val_fraction: {fraction} of {len(texts)} distinct prompts holds out {n_out}, leaving none to train on")
    random.Random(f"fleetrl-val-split-{seed}").shuffle(texts)  # str seeds are stable across processes
    held = set(texts[:n_out])
    return [it for it in items if it[0] not in held], [it for it in items if it[0] in held]


def load_datasets(cfg: Config, tokenizer) -> Datasets:
    d = cfg.data
    items = addition_items() if d.task == "addition" else read_items(d.path, d.prompt_key, d.answer_key, "data.path")
    train, val = split_holdout(items, d.val_fraction, cfg.run.seed)
    test = read_items(d.test_path, d.prompt_key, d.answer_key, "data.test_path") if d.test_path else []
    return Datasets(
        train=PromptSet(train, tokenizer, "data.path"),
        val=PromptSet(val, tokenizer, "data.val_fraction") if val else None,
        test=PromptSet(test, tokenizer, "data.test_path") if test else None,
    )
