"""The tool environment (actors/env/tools.py): calls parsed in both formats, tools run by name, every failure
answered to the model as an error and never raised."""

import asyncio
import time

from actors.env import EpisodeRow, Step
from actors.env.tools import ToolEnv, parse_hermes, parse_tags


def add(a: int, b: int) -> int:
    return a + b


async def slow(text: str) -> str:
    await asyncio.sleep(5)
    return text


def boom(text: str) -> str:
    raise ZeroDivisionError("division by zero")


class Hermes(ToolEnv):
    tools = {"add": add}


class Tags(ToolEnv):
    format = "tags"
    tools = {"calc": lambda expr: str(sum(int(x) for x in expr.split("+"))), "slow": slow, "boom": boom}
    tool_timeout_s = 0.2

    def score(self, text):
        return float(text.strip() == self.row.answer)


ROW = EpisodeRow(prompt="2+3=", answer="5")


def step(env, text):
    return asyncio.run(env.step(text))


def test_hermes_calls_are_parsed_run_and_answered_as_tool_messages():
    text = 'let me add <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert parse_hermes(text)[0].arguments == {"a": 2, "b": 3}
    out = step(Hermes(ROW), text + '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>')
    assert out == Step(observation=[{"role": "tool", "content": "5"}, {"role": "tool", "content": "2"}], tool_calls=2)


def test_hermes_errors_go_back_to_the_model():
    env = Hermes(ROW)
    cases = {
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>': "error: add failed: TypeError: add() missing 1 required",
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>': "error: unknown tool 'mul'; the tools are: add",
        "<tool_call>{not json</tool_call>": "error: the tool call is not JSON",
        '<tool_call>["add"]</tool_call>': 'error: a tool call needs {"name": "...", "arguments": {...}}',
    }
    for text, expected in cases.items():
        out = step(env, text)
        assert not out.done and out.tool_calls == 1 and out.observation[0]["content"].startswith(expected), out


def test_tags_format_and_the_final_answer():
    assert [(c.name, c.arguments) for c in parse_tags("<calc>2+3</calc> and <x>1</x><calc>4+4</calc>", ["calc"])] == [
        ("calc", "2+3"),
        ("calc", "4+4"),
    ]
    env = Tags(ROW)
    assert step(env, "<calc>2+3</calc>") == Step(observation="<result>5</result>", tool_calls=1)
    assert step(env, "5") == Step(reward=1.0, done=True)
    assert step(env, "6") == Step(reward=0.0, done=True)
    assert step(env, "<calc>2+x</calc>").observation.startswith("<error>calc failed: ValueError: invalid literal for int()")
    assert step(env, "<boom>1</boom>").observation == "<error>boom failed: ZeroDivisionError: division by zero</error>"


def test_a_slow_tool_is_cut_at_its_limit():
    t0 = time.perf_counter()
    out = step(Tags(ROW), "<slow>x</slow>")
    assert out.observation == "<error>slow took longer than 0.2 s</error>" and time.perf_counter() - t0 < 2


def test_calls_beyond_the_limit_are_answered_with_an_error():
    out = step(Tags(ROW), "<calc>1+1</calc>" * 5)
    assert out.tool_calls == 5 and out.observation.endswith("<error>too many tool calls in one turn</error>")
    assert out.observation.count("<result>2</result>") == 4
