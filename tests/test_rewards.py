import pytest

from actors.rewards import exact_match, load_reward_fn, math_answer


def test_exact_match():
    assert exact_match(" 12 ", "12") == 1.0 and exact_match("13", "12") == 0.0


def test_math_answer_checks_value_not_text():
    assert math_answer("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_answer("the answer is $\\boxed{3}$", "4") == 0.0
    assert math_answer("no number here", "4") == 0.0


def test_load_by_import_path():
    assert load_reward_fn("actors.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(ValueError, match="has no function"):
        load_reward_fn("actors.rewards:nope")
