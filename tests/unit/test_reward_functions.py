"""Rewards (actors/rewards/), in-process: the context and the two forms, a group's parts and errors as the wire carries
them, and each built-in against hand-made cases that pin the source behaviour it reproduces. The worker pool (a
timeout, an exception or a dead worker scores 0 and is counted; a hung worker is replaced) and the actor's use of it:
tests/integration/test_rewards.py."""

import numpy as np
import pytest

from actors.rewards import (
    Outcome,
    RewardContext,
    assemble,
    by_dataset,
    exact_match,
    load_reward,
    load_reward_fn,
    math_answer,
    math_verify,
    open_instruct,
    orz,
    parse_metadata,
    score_one,
    simplerl_answer,
    simplerl_math,
)
from actors.rewards.builtin import last_boxed
from actors.rewards.verifiers import OpenInstructReward, gsm8k, math


def ctx(completion, answer="", finish_reason="stop", metadata=None, prompt=""):
    return RewardContext(completion=completion, prompt=prompt, answer=answer, metadata=metadata or {}, finish_reason=finish_reason)


# ---- the context, the forms, a group --------------------------------------------------------------------


def test_old_builtins_keep_their_import_paths_and_behaviour():
    assert load_reward_fn("actors.rewards:exact_match") is exact_match
    assert exact_match(" 12 ", "12") == 1.0 and exact_match("13", "12") == 0.0
    assert math_answer("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_answer("the answer is $\\boxed{3}$", "4") == 0.0
    assert math_answer("no number here", "4") == 0.0


def test_the_form_is_read_from_the_signature():
    old = load_reward("tests.reward_fns:legacy")
    new = load_reward("tests.reward_fns:context_len")
    assert not old.takes_context and new.takes_context
    assert old(ctx("ab", answer="ab")) == (1.0, {})  # called as fn(completion, answer)
    assert new(ctx("abc", metadata={"bonus": 2})) == (5.0, {"length": 3.0, "stopped": 1.0})
    assert load_reward("actors.rewards:open_instruct").takes_context  # a callable instance: its __call__'s signature
    with pytest.raises(ValueError, match=r"rollout.reward_fn: .*three_args\(a, b, c\) must take one argument"):
        load_reward("tests.reward_fns:three_args")
    with pytest.raises(ValueError, match="rollout.reward_fn: cannot import"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="rollout.reward_fn: 'actors.rewards' has no function 'nope'"):
        load_reward("actors.rewards:nope")


def test_a_failing_reward_is_an_error_outcome_with_its_first_line():
    reward = load_reward("tests.reward_fns:behaves")
    assert score_one(reward, ctx("fine")) == Outcome(1.0, {})
    assert score_one(reward, ctx("raise")) == Outcome(0.0, {}, "RuntimeError: no such key")
    assert score_one(reward, ctx("nan")).error == "ValueError: the score is nan, not a finite float32"
    assert score_one(reward, ctx("text")).error == "TypeError: returned str; expected a float or (float, {name: float})"
    # Parts are metrics: what the wire cannot carry is dropped when the group is assembled, never the score.
    assert score_one(reward, ctx("many parts")) == Outcome(1.0, {f"p{i:02d}": 0.0 for i in range(17)})
    assert score_one(reward, ctx("bad part name")) == Outcome(1.0, {"a\nb": 0.0})


def test_group_parts_get_every_name_and_zero_where_missing():
    """RolloutGroup.reward_parts is [n * k] row-major over sorted names; a part one completion lacks (or an error) is 0."""
    scores = assemble([Outcome(1.0, {"b": 2.0, "a": 1.0}), Outcome(0.0, {}, "TimeoutError: 1 s"), Outcome(0.5, {"c": 3.0})])
    assert scores.part_names == ["a", "b", "c"]
    np.testing.assert_array_equal(scores.parts, np.array([1, 2, 0, 0, 0, 0, 0, 0, 3], np.float32))
    np.testing.assert_array_equal(scores.rewards, np.array([1.0, 0.0, 0.5], np.float32))
    assert scores.errors == 1 and scores.first_error == "TimeoutError: 1 s"
    plain = assemble([Outcome(1.0, {}), Outcome(0.0, {})])
    spread = assemble([Outcome(1.0, {f"p{i:02d}": 1.0 for i in range(10)}), Outcome(1.0, {f"q{i:02d}": 1.0 for i in range(10)})])
    assert spread.part_names == [f"p{i:02d}" for i in range(10)] + [f"q{i:02d}" for i in range(6)]  # 16, the most the hub takes
    assert spread.dropped_parts == [f"q{i:02d}" for i in range(6, 10)] and spread.rewards.tolist() == [1.0, 1.0]
    odd = assemble([Outcome(0.5, {"ok": 1.0, "a\nb": 1.0, "": 2.0, "x" * 65: 3.0, "inf": float("inf")}), Outcome(1.0, {"big": 1e39})])
    assert odd.part_names == ["ok"] and odd.parts.tolist() == [1.0, 0.0] and odd.rewards.tolist() == [0.5, 1.0]
    assert odd.dropped_parts == sorted(["a\nb", "", "x" * 65, "inf", "big"]) and odd.errors == 0
    assert plain.part_names == [] and plain.parts.shape == (0,) and plain.parts.dtype == np.float32


def test_metadata_is_a_json_object_or_empty():
    assert parse_metadata("") == {} and parse_metadata("{}") == {}
    assert parse_metadata('{"dataset": "gsm8k", "n": [1]}') == {"dataset": "gsm8k", "n": [1]}
    with pytest.raises(ValueError, match="not an object"):
        parse_metadata("[1, 2]")
    with pytest.raises(ValueError):
        parse_metadata("{oops")


# ---- built-ins ------------------------------------------------------------------------------------------


def test_last_boxed_matches_nested_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed {7}") == "7"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None


def test_math_verify_compares_the_last_box_by_value():
    assert math_verify(ctx("so x = \\boxed{\\frac{1}{2}}", answer="0.5")) == (1.0, {"boxed": 1.0})
    assert math_verify(ctx("\\boxed{1} then \\boxed{3}", answer="3")) == (1.0, {"boxed": 1.0})
    assert math_verify(ctx("\\boxed{4}", answer="3")) == (0.0, {"boxed": 1.0})
    assert math_verify(ctx("the answer is 3", answer="3")) == (0.0, {"boxed": 0.0})  # boxed answers only
    assert math_verify(ctx("\\boxed{x^2+1}", answer="The solution gives $\\boxed{1+x^2}$.")) == (1.0, {"boxed": 1.0})


def test_orz_reward():
    """Open-Reasoner-Zero (playground/orz_7b_ppo.py): the answer is the box inside <answer>...</answer> (pattern
    `<answer>.*?(\\boxed{.*}).*?</answer>`, then its last box); a response whose stop_reason is not "stop" scores 0
    even when right; the comparison is case-insensitive string equality or equal value (math_verify mode). The
    "</answer>" stop string is in the text because ORZ sets include_stop_str_in_output=True."""
    right = "<think> 2+2 </think> <answer> The answer is \\boxed{4} </answer>"
    assert orz(ctx(right, answer="4")) == (1.0, {"correct": 1.0, "formatted": 1.0})
    assert orz(ctx(right, answer="4", finish_reason="length")) == (0.0, {"correct": 1.0, "formatted": 1.0})
    assert orz(ctx(right, answer="5")) == (0.0, {"correct": 0.0, "formatted": 1.0})
    assert orz(ctx(right.replace("</answer>", ""), answer="4")) == (0.0, {"correct": 0.0, "formatted": 0.0})  # stop string cut
    assert orz(ctx("\\boxed{4}", answer="4")) == (0.0, {"correct": 0.0, "formatted": 0.0})  # no <answer> tags
    assert orz(ctx("<answer>4</answer>", answer="4")) == (0.0, {"correct": 0.0, "formatted": 0.0})  # tags without a box
    assert orz(ctx("<answer>\\boxed{\\dfrac{1}{2}}</answer>", answer="\\boxed{0.5}"))[0] == 1.0  # the gold's box, by value
    assert orz(ctx("<answer>\\boxed{Monday}</answer>", answer="monday"))[0] == 1.0  # case-insensitive strings


def test_simplerl_extraction_falls_back_without_a_box():
    """SimpleRL-Zoo (hf_math_verify.py -> Qwen2.5-Math's extract_answer(text, "math")): the Minerva line, else the last
    `boxed`, else after the last "he answer is", else after the last "final answer is", else the last number; then a
    newline, one leading ":" and trailing "." / "/" are dropped."""
    assert simplerl_answer("So the answer is 5.") == "5"
    assert simplerl_answer("The answer is: 7.") == "7"
    assert simplerl_answer("The answer is 3. Checking again, the answer is 4.") == "4"  # the last occurrence
    assert simplerl_answer("Thus our final answer is 12") == "12"
    assert simplerl_answer("we get 3 apples, then 1,042 pears") == "1042"  # the last number, commas removed
    assert simplerl_answer("x = -2.5 or so") == "-2.5"
    assert simplerl_answer("Final Answer: The final answer is $6$. I hope it is correct.") == "6"
    assert simplerl_answer("no answer here") == ""


def test_simplerl_box_wins_and_nested_braces():
    assert simplerl_answer("The answer is 4. No: \\boxed{5}, and then 6") == "5"  # the box before any fallback
    assert simplerl_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # the last box
    assert simplerl_answer("\\boxed{\\sqrt{a^{2}}+{b}} tail") == "\\sqrt{a^{2}}+{b}"  # braces matched, nested ones kept
    assert simplerl_answer("$\\boxed 7$ done") == "7"  # no brace: up to the next "$"
    assert simplerl_answer("unclosed \\boxed{3+4") == "3+4"  # never closed: everything after the brace


def test_simplerl_math_scores_what_math_verify_misses():
    """The same completions score 0 with `math_verify` (a box or nothing) and 1 with SimpleRL's fallbacks."""
    for completion, answer in [
        ("2 + 3 = 5, so the answer is 5.", "5"),
        ("Hence the final answer is \\frac{1}{2}", "0.5"),
        ("Adding them up gives 42", "42"),
        ("The answer is $\\frac{3}{4}$.", "\\frac34"),
    ]:
        assert math_verify(ctx(completion, answer=answer))[0] == 0.0
        assert simplerl_math(ctx(completion, answer=answer)) == (1.0, {"boxed": 0.0}), completion
    assert simplerl_math(ctx("The answer is 4, or \\boxed{5}", answer="5")) == (1.0, {"boxed": 1.0})
    assert simplerl_math(ctx("The answer is 4, or \\boxed{5}", answer="4")) == (0.0, {"boxed": 1.0})  # the box wins
    assert simplerl_math(ctx("\\boxed{\\frac{1}{2}}", answer="\\boxed{0.5}"))[0] == 1.0  # a boxed reference is kept
    assert simplerl_math(ctx("the answer is 5<|im_end|> the answer is 6", answer="5"))[0] == 1.0  # cut at the end marker
    assert simplerl_math(ctx("no idea", answer="5")) == (0.0, {"boxed": 0.0})
    assert simplerl_math(ctx("the answer is 5", answer="5", finish_reason="length"))[0] == 1.0  # truncated: scored alike
    assert load_reward("actors.rewards:simplerl_math").takes_context


def test_gsm8k_verifier():
    """open-instruct GSM8KVerifier: commas between digits removed, the LAST number compared as text to the label."""
    assert gsm8k("3 apples + 15 = 18 apples. The answer is 18", "18") == 1.0
    assert gsm8k("It costs 1,234 dollars", "1234") == 1.0
    assert gsm8k("18 at first, then 20", "18") == 0.0
    assert gsm8k("18.0", "18") == 0.0  # text, not value, as open-instruct compares
    assert gsm8k("no number", "18") == 0.0


def test_math_verifier_candidates():
    """open-instruct MathVerifier: the last box, the Minerva "The final answer is X. I hope it is correct." line,
    else the last $...$, else the whole response; any candidate equal to the label scores 1."""
    assert math("work... \\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert math("Final Answer: The final answer is $6$. I hope it is correct.", "6") == 1.0
    assert math("we get $x = 1$ and so $5$ apples", "5") == 1.0
    assert math("7", "7") == 1.0
    assert math("\\boxed{3}", "4") == 0.0


def test_dispatch_by_dataset():
    """open-instruct picks the verifier by the row's dataset name, lowercased; FleetRL makes an unknown or missing
    name an error that names it (open-instruct logs a warning and scores 0)."""
    assert by_dataset(ctx("so 42", answer="42", metadata={"dataset": "gsm8k"})) == 1.0
    assert by_dataset(ctx("\\boxed{0.5}", answer="\\frac{1}{2}", metadata={"dataset": "MATH"})) == 1.0
    assert by_dataset(ctx("all quiet", answer='{"func_name": "validate_lowercase", "N": null}', metadata={"dataset": "ifeval"})) == 1.0
    with pytest.raises(ValueError, match="no verifier for dataset 'flan'"):
        by_dataset(ctx("x", metadata={"dataset": "flan"}))
    with pytest.raises(ValueError, match="metadata\\['dataset'\\] is None"):
        by_dataset(ctx("x"))
    out = score_one(load_reward("actors.rewards:by_dataset"), ctx("x", metadata={"dataset": "code"}))
    assert out == Outcome(0.0, {}, "ValueError: no verifier for dataset 'code' (known: gsm8k, math, ifeval)")


def test_open_instruct_scale_and_non_stop_penalty():
    """Tulu-3-8B RLVR (open-instruct docs/tulu3.md): verification_reward 10 x the verifier; --non_stop_penalty with
    --penalty_reward_value -10.0 replaces the score of a response that did not stop."""
    row = {"dataset": "gsm8k"}
    assert open_instruct(ctx("= 42", answer="42", metadata=row)) == (10.0, {"verified": 1.0})
    assert open_instruct(ctx("= 41", answer="42", metadata=row)) == (0.0, {"verified": 0.0})
    assert open_instruct(ctx("= 42", answer="42", metadata=row, finish_reason="length")) == (-10.0, {"verified": 1.0})
    grpo = OpenInstructReward(verification_reward=1.0, non_stop_penalty_value=0.0)
    assert grpo(ctx("= 42", answer="42", metadata=row, finish_reason="length")) == (0.0, {"verified": 1.0})
    assert OpenInstructReward(non_stop_penalty_value=None)(ctx("= 42", answer="42", metadata=row, finish_reason="length"))[0] == 10.0
