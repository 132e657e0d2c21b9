"""The sandbox's and the code reward's pure parts: limit checks, how a run's ending is named, code extraction and
the test-case shapes. The sandbox running real code: tests/integration/test_sandbox.py, test_code_reward.py."""

from __future__ import annotations

import signal

import pytest

from actors.rewards.code import Case, extract_code, parse_tests
from actors.sandbox import SandboxLimits
from actors.sandbox.result import classify


@pytest.mark.parametrize("field,value", [("wall_s", 0), ("cpu_s", -1), ("memory_bytes", 1.5), ("processes", True), ("output_bytes", "1")])
def test_limits_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}"):
        SandboxLimits(**{field: value})


def reason(returncode=0, timed_out=False, output_exceeded=False, stderr=b"", cpu_s=0.0):
    return classify(returncode=returncode, timed_out=timed_out, output_exceeded=output_exceeded, stderr=stderr, cpu_s=cpu_s, cpu_limit_s=2)


def test_classify():
    assert reason() == "ok"
    assert reason(1, stderr=b"Traceback...\nAssertionError\n") == "exit"
    assert reason(-9, timed_out=True) == "timeout"
    assert reason(-9, timed_out=True, output_exceeded=True) == "output"
    assert reason(-signal.SIGXCPU) == "cpu"
    assert reason(-9, cpu_s=3.0) == "cpu"  # the hard limit's SIGKILL
    assert reason(-9, cpu_s=0.1) == "killed"
    assert reason(-signal.SIGSEGV) == "killed"
    assert reason(-signal.SIGXFSZ) == "file_size"
    assert reason(1, stderr=b"...\nMemoryError\n") == "memory"
    assert reason(1, stderr=b"numpy._core._exceptions._ArrayMemoryError: Unable to allocate\n") == "memory"
    assert reason(1, stderr=b"OSError: [Errno 27] File too large\n") == "file_size"
    assert reason(1, stderr=b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n") == "processes"


def test_extract_code_takes_the_last_closed_python_block():
    text = "```python\nfirst\n```\nthen\n```py\nsecond\n```\n```bash\nls\n```\n```python\nunclosed"
    assert extract_code(text) == "second\n"
    assert extract_code("```\nplain\n```") is None
    assert extract_code("no code") is None


def test_parse_tests_shapes():
    pairs = [Case(stdin="1\n", expected="2\n"), Case(stdin="a\nb", expected="c")]
    assert parse_tests({}, '{"inputs": ["1\\n", ["a", "b"]], "outputs": ["2\\n", "c"]}') == pairs
    assert parse_tests({"tests": [{"input": "1\n", "output": "2\n"}]}, "ignored") == pairs[:1]
    assert parse_tests({"tests": '["assert f() == 1"]'}, "") == [Case(statement="assert f() == 1")]


@pytest.mark.parametrize(
    "answer,match",
    [
        ("not json", "not JSON"),
        ('{"inputs": ["1"], "outputs": []}', "1 inputs but 0 outputs"),
        ('{"fn_name": "f", "inputs": [], "outputs": []}', "fn_name"),
        ("[]", "has none"),
        ("[1, 2]", "expected"),
    ],
)
def test_parse_tests_errors_say_what_is_wrong(answer, match):
    with pytest.raises(ValueError, match=match):
        parse_tests({}, answer)
