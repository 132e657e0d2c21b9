"""From a dataset row to what the model and the reward see: the rendered prompt, the answer, the metadata.

    row --data.format's columns, or data.prompt_key / data.answer_key (dotted: reward_model.ground_truth)-->
        prompt: a string  --data.prompt_template ("{prompt}")--> text --data.chat_template: as a user turn-+
                a list of chat messages ({"role", "content"}) ------------------------------------------+--> tokenizer's chat template
        answer: a string or number (a one-element list of one is unwrapped) -> text
        the other columns (or data.metadata_keys) -> one JSON object, at most data.max_metadata_bytes

Built-in formats (data.format) name the columns of the seed datasets as they ship:
- plain: `prompt` and `answer`.
- orz: Open-Reasoner-Zero's JSON. Training files are a list of turn pairs
  [{"from": "human", "value": Q}, {"from": "assistant", "ground_truth": {"value": A}}], which `datasets` reads as
  columns "0" and "1"; its evaluation files hold {"prompt": [{"from": "human", "value": Q}], "final_answer": A,
  "file_name": ...}. The prompt template is ORZ's (playground/zero_setting_base.py), for base models.
- verl: verl's and SimpleRL-Zoo's Parquet: chat-list `prompt`, answer in `reward_model.ground_truth`; the
  metadata keeps `data_source`, `ability` and `extra_info`.
- open_instruct: open-instruct's RLVR rows: chat-list `messages`, `ground_truth`, and `dataset` (the verifier's
  name, in the metadata).
Chat prompts that end with assistant turns lose them: those hold the reference reply (open-instruct's SFT-style
`messages`), not the prompt. open-instruct drops the last message of any longer list; a list that ends with a
user turn is kept whole here.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from learner.data.sources import Part, read_source
from protocol.config import ConfigError, DataConfig

ORZ_TEMPLATE = (
    "{bos_token}A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>. "
    "User: You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem:\n{prompt}\nAssistant: <think>"
)


@dataclass(frozen=True, slots=True)
class Format:
    shapes: tuple[tuple[str, str], ...]  # (prompt key, answer key): the first whose columns a file has is used
    prompt_template: str = "{prompt}"  # the template when data.prompt_template is ""


FORMATS = {
    "plain": Format((("prompt", "answer"),)),
    "orz": Format((("0.value", "1.ground_truth.value"), ("prompt.0.value", "final_answer")), ORZ_TEMPLATE),
    "verl": Format((("prompt", "reward_model.ground_truth"),)),
    "open_instruct": Format((("messages", "ground_truth"),)),
}


class Row(NamedTuple):
    text: str  # the prompt as the model sees it (templates applied)
    answer: str  # the reference answer, as text
    metadata: str = "{}"  # JSON object: the row's other columns, for the reward


_MISSING = object()


def lookup(row: dict[str, Any], key: str) -> Any:
    """row[key], or down a dotted path ("reward_model.ground_truth", "prompt.0.value"); _MISSING when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def column_of(key: str, columns: list[str]) -> str:
    """The top-level column a (dotted) key lives in."""
    return key if key in columns else key.split(".")[0]


def check_chat_template(d: DataConfig, tokenizer) -> None:
    if d.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.chat_template: the tokenizer at model.path has no chat template: set data.chat_template "
            '= false and use data.prompt_template, or add a "chat_template" to its tokenizer_config.json'
        )


def read_rows(source: str, field: str, d: DataConfig, tokenizer, split: str) -> list[Row]:
    """Every row of `source` (file, folder or hub id), rendered; ConfigError naming file, row and column."""
    reader = RowReader(d, tokenizer)
    return [row for part in read_source(source, field, split=split, subset=d.subset) for row in reader.read(part, field)]


class RowReader:
    def __init__(self, d: DataConfig, tokenizer):
        self.d, self.tokenizer = d, tokenizer
        self.format = FORMATS[d.format]
        self.template = d.prompt_template or self.format.prompt_template
        bos = getattr(tokenizer, "bos_token", None)
        self.template = self.template.replace("{bos_token}", bos if isinstance(bos, str) else "")

    def keys(self, part: Part, field: str) -> tuple[str, str]:
        """The (prompt, answer) keys for this file: the configured ones, else the format's first shape it has."""
        shapes = self.format.shapes
        if self.d.prompt_key or self.d.answer_key:
            shapes = ((self.d.prompt_key or shapes[0][0], self.d.answer_key or shapes[0][1]),)
        for p, a in shapes:
            if column_of(p, part.columns) in part.columns and column_of(a, part.columns) in part.columns:
                return p, a
        want = " or ".join(f"{p!r} and {a!r}" for p, a in shapes)
        raise ConfigError(
            f"{field}: {part.name}: no columns {want} for data.format = {self.d.format!r} (has: "
            f"{', '.join(map(repr, part.columns)) or 'nothing'}); set data.format, or data.prompt_key and data.answer_key"
        )

    def read(self, part: Part, field: str) -> list[Row]:
        if not part.rows:
            return []
        prompt_key, answer_key = self.keys(part, field)
        for key in self.d.metadata_keys:
            if column_of(key, part.columns) not in part.columns:
                raise ConfigError(
                    f"{field}: {part.name}: data.metadata_keys names {key!r}, not a column here (has: {', '.join(map(repr, part.columns))})"
                )
        exclude = {column_of(prompt_key, part.columns), column_of(answer_key, part.columns)}
        out = []
        for i, row in enumerate(part.rows):
            where = f"{field}: {part.name}: row {i} (0-based)"
            text = self.render(prompt_of(lookup(row, prompt_key), where, prompt_key), where, prompt_key)
            answer = answer_of(lookup(row, answer_key), where, answer_key)
            if self.d.metadata_keys:
                meta = {k: lookup(row, k) for k in self.d.metadata_keys}
                meta = {k: (None if v is _MISSING else v) for k, v in meta.items()}
            else:
                meta = {k: v for k, v in row.items() if k not in exclude}
            out.append(Row(text, answer, self.metadata(meta, where)))
        return out

    def render(self, prompt: str | list[dict[str, Any]], where: str, key: str) -> str:
        if isinstance(prompt, str):
            text = self.template.replace("{prompt}", prompt)
            if not self.d.chat_template:
                return text
            prompt = [{"role": "user", "content": text}]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"{where}: column {key!r} holds chat messages, and the tokenizer at model.path has no chat "
                "template to render them: use a tokenizer with one (its tokenizer_config.json's "
                '"chat_template"), or string prompts with data.prompt_template'
            )
        import jinja2

        try:
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{where}: the tokenizer's chat template failed on column {key!r}: {e}") from e
        assert isinstance(text, str)
        return text

    def metadata(self, meta: dict[str, Any], where: str) -> str:
        text = json.dumps(plain(meta), ensure_ascii=False, allow_nan=False)
        size = len(text.encode())
        if size > self.d.max_metadata_bytes:
            sizes = {k: len(json.dumps(plain(v), ensure_ascii=False).encode()) for k, v in meta.items()}
            big = max(sizes, key=lambda k: sizes[k])
            raise ConfigError(
                f"{where}: its metadata is {size} bytes of JSON, over data.max_metadata_bytes ({self.d.max_metadata_bytes}); "
                f"column {big!r} alone is {sizes[big]}. Every grant carries it and the learner holds every row's: list the "
                f"columns the reward needs in data.metadata_keys, or raise data.max_metadata_bytes"
            )
        return text


def prompt_of(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    """A non-empty string, or a chat list of {"role", "content"} strings with trailing assistant turns dropped."""
    if value is _MISSING or value is None:
        raise ConfigError(f"{where}: column {key!r} is missing or null")
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"{where}: column {key!r} is empty")
        return value
    if not isinstance(value, list):
        raise ConfigError(
            f"{where}: column {key!r} must be a string or a list of chat messages "
            f'({{"role", "content"}}), got {type(value).__name__} {value!r:.60}'
        )
    messages = []
    for j, m in enumerate(value):
        # Arrow gives every message the union of all messages' keys, None where one had none: drop those.
        m = {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f'{where}: column {key!r}, message {j}: expected {{"role": str, "content": str}}, got {m!r:.80}')
        messages.append(m)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise ConfigError(f"{where}: column {key!r} has no message before the assistant's reply")
    return messages


def answer_of(value: Any, where: str, key: str) -> str:
    if isinstance(value, list) and len(value) == 1:  # open-instruct also writes ground truths as one-element lists
        value = value[0]
    if value is _MISSING or value is None:
        raise ConfigError(f"{where}: column {key!r} is missing or null")
    # Numeric answers are common in math sets ("answer": 42); they are compared as text.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{where}: column {key!r} must be a string or number, got {type(value).__name__} {value!r:.40}")
    return str(value)


def plain(value: Any) -> Any:
    """JSON-ready: NaN and infinities become null, bytes base64 text, dates ISO text, numpy values Python ones."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.generic):
        return plain(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int | bool):
        return value
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return str(value)  # timedelta and any other Arrow-made value: its text
