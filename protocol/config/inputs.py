"""What a run starts from: its directory and seed, the model, the prompt set, and the demo's own model."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from protocol.config.errors import check_choices, need

Dtype = Literal["float32", "bfloat16"]
DataTask = Literal["addition", "file"]
DataFormat = Literal["plain", "orz", "verl", "open_instruct"]  # learner/data/rows.py's FORMATS
DATA_FORMATS: tuple[DataFormat, ...] = typing.get_args(DataFormat)
LongPrompts = Literal["drop", "truncate"]


@dataclass(kw_only=True, slots=True)
class RunConfig:
    dir: str = "runs/demo"  # run directory: resolved config, logs, metrics.jsonl, checkpoints, plots
    seed: int = 0  # seeds the prompt order, sampling and the learner's init


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = ""  # Hugging Face model folder (local); the demo builds one when empty
    dtype: Dtype = "float32"  # float32 | bfloat16; the same on learner and engines so logprobs compare
    num_params: int = 0  # parameter count for `fleetrl plan`'s memory estimate; 0 = count from the config.json
    arch: str = ""  # a config.json of the model's architecture, for `fleetrl plan` when model.path is not here (configs/models/)

    def __post_init__(self) -> None:
        check_choices(self, "model")
        need(self.num_params >= 0, "model.num_params", "must be >= 0 (0 = count from model.path)")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: DataTask = "addition"  # built-in prompt set ("addition"), or "file": the rows at `path`
    digits: int = 1  # addition's operands: 1 = the 0..9 table (100 prompts); n > 1: 4,096 seeded sums of n-digit numbers
    path: str = ""  # prompt set when task = "file": a .json/.jsonl/.parquet file, a folder of them, or a hub dataset id
    format: DataFormat = "plain"  # column mapping: plain (prompt, answer) | orz | verl | open_instruct (learner/data/rows.py)
    prompt_key: str = ""  # column holding the prompt, a string or chat messages; dotted for nested ("" = data.format's)
    answer_key: str = ""  # column holding the reference answer; dotted for nested, e.g. reward_model.ground_truth ("" = data.format's)
    prompt_template: str = ""  # a string prompt's text: "{prompt}" (and "{bos_token}") replaced ("" = data.format's; plain: "{prompt}")
    chat_template: bool = False  # render string prompts as a user turn through the tokenizer's chat template (chat lists always are)
    # columns sent to the reward as metadata (dotted ok); [] = all but prompt and answer
    metadata_keys: list[str] = field(default_factory=list)
    max_metadata_bytes: int = 65536  # a row's metadata JSON above this is an error: every grant carries it, the learner holds all
    split: str = "train"  # split of a hub dataset at data.path
    subset: str = ""  # hub dataset configuration name (e.g. "main" for openai/gsm8k); "" = its default
    val_fraction: float = 0.0  # share of the prompt set held out for validation (never trained on)
    test_path: str = ""  # separate test set (same forms as data.path), evaluated like the validation split
    test_split: str = "test"  # split of a hub dataset at data.test_path
    # Passes over the prompt set at most: the run ends at train.total_steps or when these run out
    # (learner.data_exhausted), whichever comes first.
    epochs: int = 1000
    num_prompts: int = 0  # size of the prompt set when the file is not at hand, for `fleetrl plan` (0 = unknown)
    # prompt tokens allowed; 0 = actor.max_model_len - rollout.max_tokens, so every prompt can generate max_tokens.
    # Above that, a completion ends where prompt + completion reach actor.max_model_len (finish reason "length").
    max_prompt_tokens: int = 0
    long_prompts: LongPrompts = "drop"  # a prompt over max_prompt_tokens: drop (logged, counted) | truncate (keep its first tokens)

    def __post_init__(self) -> None:
        check_choices(self, "data")
        need(self.task != "file" or bool(self.path), "data.path", "required when data.task = 'file'")
        need(
            not self.prompt_template or "{prompt}" in self.prompt_template,
            "data.prompt_template",
            "must contain {prompt}, where the row's prompt goes",
        )
        need(all(self.metadata_keys), "data.metadata_keys", "an empty column name")
        need(self.max_metadata_bytes >= 2, "data.max_metadata_bytes", "must be >= 2 (the empty object {})")
        need(0 <= self.val_fraction < 1, "data.val_fraction", "must be in [0, 1)")
        need(self.epochs >= 1, "data.epochs", "must be >= 1")
        need(1 <= self.digits <= 6, "data.digits", f"{self.digits} must be in 1..6")
        need(self.num_prompts >= 0, "data.num_prompts", "must be >= 0 (0 = unknown)")
        need(self.max_prompt_tokens >= 0, "data.max_prompt_tokens", "must be >= 0 (0 = actor.max_model_len - rollout.max_tokens)")


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    num_actors: int = 2  # actor processes started by `fleetrl demo`
    warmstart_steps: int = 300  # full-batch supervised steps that give the tiny model its starting policy
    warmstart_smoothing: float = 0.45  # label smoothing of that run: how unsure (high-entropy) the start is
    # the tool demo (configs/demo_tools.toml): the warm start also shows the calculator tool (actors/env/demo.py) on
    # this share of its examples, and answers directly on the rest
    tool_share: float = 0.0

    def __post_init__(self) -> None:
        need(self.num_actors >= 1, "demo.num_actors", "must be >= 1")
        need(self.warmstart_steps >= 0, "demo.warmstart_steps", "must be >= 0")
        need(0 <= self.warmstart_smoothing < 1, "demo.warmstart_smoothing", "must be in [0, 1)")
        need(0 <= self.tool_share <= 1, "demo.tool_share", "must be in [0, 1]")
