"""Tool calling on the environment interface: the model's calls parsed, plain Python functions run, results answered.

    model turn --parse (hermes | tags)--> calls --run each (by name, under a time limit)--> results
        --> Step(observation = the results, tool_calls = how many)        no call: the final answer, Step(done)

Two call formats:
- "hermes": `<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>`, the format Qwen2.5
  and Hermes models are trained on and vLLM's hermes tool parser reads. Results go back as chat messages of role
  "tool", rendered by the tokenizer's chat template (actors/episode.py).
- "tags", for small models: `<calc>2+3</calc>`, a registered tool's name as the tag and its one argument as
  text. Results go back as text: `<result>5</result>`, or `<error>...</error>`.

A tool is a function registered by name in `tools` (plain or async; keyword arguments for hermes, one string
for tags). Anything wrong is answered to the model as an error, never raised: an unknown tool, arguments that
are not JSON or do not fit the function, an exception, a call over `tool_timeout_s`. A subclass names its tools
and scores the final answer:

    class Calculator(ToolEnv):
        format = "tags"
        tools = {"calc": calc}

        def score(self, text: str) -> float | None:
            return float(text.strip().removesuffix("<eos>") == self.row.answer)
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from actors.env.base import EpisodeRow, Step
from protocol.logs import first_line

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] | str  # keyword arguments (hermes) or the one text argument (tags)
    error: str = ""  # the call could not be read: answered as this error


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` of `text`, in order; an unreadable one is a call carrying its error."""
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({e.msg} at {e.pos})"))
            continue
        name, args = (data.get("name"), data.get("arguments", {})) if isinstance(data, dict) else (None, None)
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(ToolCall(str(name or ""), {}, 'a tool call needs {"name": "...", "arguments": {...}}'))
            continue
        calls.append(ToolCall(name, args))
    return calls


def parse_tags(text: str, names: list[str]) -> list[ToolCall]:
    """Every `<name>argument</name>` of `text` for a registered name, in order."""
    if not names:
        return []
    pattern = re.compile("<(" + "|".join(re.escape(n) for n in names) + r")>(.*?)</\1>", re.DOTALL)
    return [ToolCall(m.group(1), m.group(2)) for m in pattern.finditer(text)]


class ToolEnv:
    """An environment whose model calls tools until it answers without one. Subclass it: `tools`, `format`, `score`."""

    tools: ClassVar[dict[str, Callable[..., Any]]] = {}
    format: ClassVar[Literal["hermes", "tags"]] = "hermes"
    tool_timeout_s: ClassVar[float] = 10.0  # one call's limit; run code in actors/sandbox for more than a time limit
    max_calls_per_turn: ClassVar[int] = 4  # calls beyond this in one turn are answered with an error

    def __init__(self, row: EpisodeRow):
        self.row = row

    def score(self, text: str) -> float | None:
        """The final answer's reward (the model's last turn); None: rollout.reward_fn scores the whole episode."""
        return None

    async def step(self, text: str) -> Step:
        calls = parse_hermes(text) if self.format == "hermes" else parse_tags(text, list(self.tools))
        if not calls:
            return Step(reward=self.score(text), done=True)
        results = [
            await self.call(c) if i < self.max_calls_per_turn else (False, "too many tool calls in one turn") for i, c in enumerate(calls)
        ]
        return Step(observation=self.render(calls, results), tool_calls=len(calls))

    async def call(self, c: ToolCall) -> tuple[bool, str]:
        """(ok, text): the tool's result as text, or the error the model is told."""
        if c.error:
            return False, c.error
        fn = self.tools.get(c.name)
        if fn is None:
            return False, f"unknown tool {c.name!r}; the tools are: {', '.join(self.tools) or 'none'}"
        args, kwargs = ((c.arguments,), {}) if isinstance(c.arguments, str) else ((), c.arguments)
        try:
            if inspect.iscoroutinefunction(fn):
                out = await asyncio.wait_for(fn(*args, **kwargs), self.tool_timeout_s)
            else:
                out = await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), self.tool_timeout_s)
        except TimeoutError:
            return False, f"{c.name} took longer than {self.tool_timeout_s:g} s"
        except Exception as e:  # the tool's failure is the model's information, not the actor's problem
            return False, f"{c.name} failed: {first_line(e)}"
        return True, out if isinstance(out, str) else json.dumps(out, default=str)

    def render(self, calls: list[ToolCall], results: list[tuple[bool, str]]) -> str | list[dict[str, str]]:
        if self.format == "tags":
            return "".join(f"<result>{text}</result>" if ok else f"<error>{text}</error>" for ok, text in results)
        return [{"role": "tool", "content": text if ok else f"error: {text}"} for ok, text in results]
