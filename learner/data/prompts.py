"""Prompt sets: the built-in addition task, or rows read through Hugging Face `datasets` and rendered.

    data.path --read (learner/data/sources.py), render (learner/data/rows.py)--> rows
        --split by data.val_fraction (seeded, by prompt text)--> train | val
    data.test_path --read, render--> test
    each set: tokenize; a prompt over the budget (data.max_prompt_tokens, by default actor.max_model_len -
        rollout.max_tokens) is dropped, or truncated to its first tokens (data.long_prompts); either is logged

Only the training split becomes the ledger's PromptSet; the validation and test sets are evaluated by the
actors and never trained on. The split goes by distinct rendered prompt text, so a prompt repeated in the
file cannot sit on both sides. By default a prompt longer than the budget could not generate rollout.max_tokens
tokens inside the engine's context, so it is dropped at load, never granted; none left is an error. A truncated
prompt keeps its first tokens (Open-Reasoner-Zero's tokenizer call with truncation, right side), and its text is
those tokens decoded, so the reward and samples.jsonl see what the model saw.
Errors name the file, the row (0-based) and the column.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from learner.data.rows import Row, check_chat_template, read_rows
from protocol.config import Config, ConfigError
from protocol.logs import get_logger

Item = tuple[str, str]  # (prompt text, reference answer): the built-in task's rows; a Row adds its metadata


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str  # as the model sees it: templates applied
    answer: str
    tokens: np.ndarray  # int32 [prompt_len]
    metadata: str = "{}"  # JSON object of the row's other columns, for the reward


class PromptSet:
    """Rows tokenized; with `max_tokens` > 0 the longer ones are dropped (counted in `dropped`), or with `truncate`
    cut to their first `max_tokens` tokens (counted in `truncated`)."""

    def __init__(self, items: Sequence[Item | Row], tokenizer, name: str = "data", max_tokens: int = 0, truncate: bool = False):
        if not items:
            raise ConfigError(f"{name}: the prompt set is empty")
        texts = [it[0] for it in items]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        self.items: list[Prompt] = []
        self.dropped = self.truncated = 0
        for i, (item, tokens) in enumerate(zip(items, ids, strict=True)):
            if not tokens:
                raise ConfigError(f"{name}: prompt {i} ({item[0][:40]!r}) tokenizes to no tokens")
            text = item[0]
            if max_tokens and len(tokens) > max_tokens:
                if not truncate:
                    self.dropped += 1
                    continue
                self.truncated += 1
                tokens = tokens[:max_tokens]
                text = tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            metadata = item[2] if len(item) > 2 else "{}"
            self.items.append(Prompt(text, item[1], np.asarray(tokens, dtype=np.int32), metadata))
        if not self.items:
            raise ConfigError(
                f"{name}: all {len(items)} prompts are longer than {max_tokens} tokens, the budget data.max_prompt_tokens "
                "(0: actor.max_model_len - rollout.max_tokens): raise it or actor.max_model_len, lower rollout.max_tokens, "
                "or set data.long_prompts = 'truncate'"
            )

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


LONG_SUMS = 4096  # addition prompts with data.digits > 1


def addition_items(max_operand: int = 9, digits: int = 1, seed: int = 0) -> list[Item]:
    """'a+b=' -> 'a+b': for single digits the whole table (100 prompts, answers of one or two characters); for
    `digits` > 1, LONG_SUMS distinct sums of two such numbers, drawn by `seed`."""
    if digits == 1:
        return [(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng, lo, hi = random.Random(f"fleetrl-sums-{digits}-{seed}"), 10 ** (digits - 1), 10**digits - 1
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < LONG_SUMS:
        pairs[(rng.randint(lo, hi), rng.randint(lo, hi))] = None
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


T = TypeVar("T", bound=tuple)


def split_holdout(items: list[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, held out): `fraction` of the distinct prompt texts, chosen by `seed`; file order kept on each side."""
    if fraction == 0:
        return items, []
    texts = list(dict.fromkeys(it[0] for it in items))
    n_out = max(1, round(fraction * len(texts)))  # a nonzero fraction asks for at least one prompt
    if n_out >= len(texts):
        raise ConfigError(f"data.val_fraction: {fraction} of {len(texts)} distinct prompts holds out {n_out}, leaving none to train on")
    random.Random(f"fleetrl-val-split-{seed}").shuffle(texts)  # str seeds are stable across processes
    held = set(texts[:n_out])
    return [it for it in items if it[0] not in held], [it for it in items if it[0] in held]


def load_datasets(cfg: Config, tokenizer) -> Datasets:
    d = cfg.data
    test: list[Row] = []
    if d.task == "file" or d.test_path:
        check_chat_template(d, tokenizer)
    if d.task == "addition":
        items = [Row(text, answer) for text, answer in addition_items(digits=d.digits, seed=cfg.run.seed)]
    else:
        items = read_rows(d.path, "data.path", d, tokenizer, d.split)
    if d.test_path:
        test = read_rows(d.test_path, "data.test_path", d, tokenizer, d.test_split)
    train, val = split_holdout(items, d.val_fraction, cfg.run.seed)
    budget, cut = cfg.prompt_budget, d.long_prompts == "truncate"
    data = Datasets(
        train=PromptSet(train, tokenizer, "data.path", budget, cut),
        val=PromptSet(val, tokenizer, "data.val_fraction", budget, cut) if val else None,
        test=PromptSet(test, tokenizer, "data.test_path", budget, cut) if test else None,
    )
    sets = {"train": data.train, **data.eval_sets()}
    log = get_logger()
    dropped = {name: s.dropped for name, s in sets.items() if s.dropped}
    truncated = {name: s.truncated for name, s in sets.items() if s.truncated}
    if dropped or truncated:
        log.warning(
            "data.too_long",
            **({"dropped": dropped} if dropped else {"truncated": truncated}),
            budget_tokens=budget,
            why="prompt longer than data.max_prompt_tokens (0: actor.max_model_len - rollout.max_tokens)",
        )
    log.info("data.loaded", **{name: len(s) for name, s in sets.items()}, example=data.train[0].text[:300])
    return data
