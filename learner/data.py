"""Prompt sets: the built-in addition task, or a local JSONL file of {"prompt", "answer"} lines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.config import ConfigError, DataConfig


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    answer: str
    tokens: np.ndarray  # int32 [prompt_len]


class PromptSet:
    def __init__(self, items: list[tuple[str, str]], tokenizer):
        if not items:
            raise ConfigError("data: the prompt set is empty")
        self.items = [
            Prompt(text, answer, np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32))
            for text, answer in items
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prompt:
        return self.items[i]


def addition_items(max_operand: int = 9) -> list[tuple[str, str]]:
    """'a+b=' -> 'a+b' for single digits: 100 prompts, answers of one or two characters."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def read_jsonl(path: str) -> list[tuple[str, str]]:
    items = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError as e:
        raise ConfigError(f"data.path: {path} not found") from e
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append((str(row["prompt"]), str(row["answer"])))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"data.path: {path}:{n}: expected {{\"prompt\": ..., \"answer\": ...}} ({e})") from e
    return items


def load_prompts(cfg: DataConfig, tokenizer) -> PromptSet:
    items = addition_items() if cfg.task == "addition" else read_jsonl(cfg.path)
    return PromptSet(items, tokenizer)
