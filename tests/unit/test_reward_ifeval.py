"""open-instruct's IFEval verifier (actors/rewards/ifeval.py): each of the 25 checks passes and fails on hand-written
responses, dispatched from a ground truth in the RLVR rows' format (every argument listed, null where unused); the text
the checks read; the Tulu 3 run's two bugs, fixed in `ifeval` and kept in `ifeval_as_run`; and a Tulu-format row from
a file, through the data loader, to the built-in `open_instruct` reward."""

import json

import pytest

from actors.rewards import (
    VERIFIERS,
    OpenInstructReward,
    Outcome,
    RewardContext,
    ifeval,
    ifeval_as_run,
    load_reward,
    open_instruct,
    parse_metadata,
    score_one,
)
from actors.rewards.ifeval import CHECKS
from deploy.tiny import build_tokenizer
from learner.data.rows import read_rows
from protocol.config import load_config

# The arguments an RLVR-GSM-MATH-IF-Mixed-Constraints ground truth lists, null where its check takes none of them.
ARGUMENTS = (
    "N",
    "quantifier",
    "end_phrase",
    "keyword_list",
    "word",
    "forbidden_words",
    "letter",
    "i",
    "first_word",
    "postscript_marker",
    "options",
    "section_splitter",
    "original_prompt",
    "language",
)


def truth(func_name, **kwargs):
    return json.dumps({"func_name": func_name, **{k: None for k in ARGUMENTS}, **kwargs})


YES_NO = ["My answer is yes.", "My answer is no.", "My answer is maybe."]

# (check, its arguments, a response that passes, responses that fail)
CASES = [
    ("verify_keywords", {"keyword_list": ["Paris", "tower"]}, "The Eiffel Tower stands in paris.", ["The Louvre is in Paris."]),
    ("verify_keyword_frequency", {"word": "cat", "N": 2}, "A cat met another Cat in the category.", ["cat cat cat", "one cat"]),
    ("validate_forbidden_words", {"forbidden_words": ["bad", "evil"]}, "All good here.", ["Not BAD at all.", "evildoer"]),
    ("verify_letter_frequency", {"letter": "z", "N": 2}, "zigzag", ["Zigzag", "zigzagz"]),  # case-sensitive
    (
        "validate_response_language",
        {"language": "en"},
        "This is an English sentence about the weather, and it is long enough to tell.",
        ["Ceci est une phrase en français sur le temps qu'il fait aujourd'hui.", "12345 678"],
    ),
    ("verify_paragraph_count", {"N": 2}, "First part.\n  * * *  \nSecond part.", ["Only one.", "One.\n* * *\n* * *\nTwo."]),
    ("validate_word_constraint", {"N": 10, "quantifier": "around"}, "one two three four five six seven eight nine", ["a b c d e f g h"]),
    ("validate_word_constraint", {"N": 3, "quantifier": "at least"}, "one two three", ["one two"]),
    ("validate_word_constraint", {"N": 3, "quantifier": "at most"}, "one two three", ["one two three four"]),
    ("validate_word_constraint", {"N": 3, "quantifier": "exactly"}, None, ["one two three"]),  # unknown quantifier
    ("verify_sentence_constraint", {"N": 2, "quantifier": "at most"}, "Dr. Smith came, e.g. by car. He left?", ["One. Two. Three."]),
    ("verify_sentence_constraint", {"N": 2, "quantifier": "at least"}, "One. Two.", ["Wow! Great! Yes."]),  # "!" ends none (as run)
    ("verify_sentence_constraint", {"N": 3, "quantifier": "around"}, "One. Two.", ["One."]),
    (
        "validate_paragraphs",
        {"N": 2, "i": 2, "first_word": "Second"},
        "Intro text.\n\nSecond, the point.",
        ["Intro.\n\nThird, the point.", "A.\n\nSecond.\n\nC.", "Intro.\nSecond."],
    ),
    ("verify_postscript", {"postscript_marker": "P.S."}, "Hello.\n\nP.S. See you soon.", ["Hello. P.S.", "Hello."]),
    ("validate_placeholders", {"N": 2}, "Dear [name], we ship to [address].", ["Dear [name]."]),
    ("verify_bullet_points", {"N": 2}, "Intro\n* one\n  - two\nend", ["* one", "* a\n* b\n* c"]),
    ("validate_title", {}, "<<Ode to Rain>>\nIt falls.", ["Ode to Rain", "<<Ode\nto Rain>>"]),
    ("validate_choice", {"options": YES_NO}, "Having thought it over: My answer is yes.", ["Perhaps."]),
    ("validate_choice", {"options": str(tuple(YES_NO))}, "My answer is no.", ["Perhaps."]),  # options as a literal string
    ("validate_highlighted_sections", {"N": 2}, "*one* and *two*", ["*one* only"]),
    (
        "validate_sections",
        {"N": 2, "section_splitter": "SECTION"},
        "SECTION 1\nfoo\nSECTION 2\nbar",
        ["SECTION 1 only", "Intro\nSECTION 1 foo\nSECTION 2 bar"],  # text before the first splitter is a section (as run)
    ),
    ("validate_json_format", {}, '{"a": [1, 2]}', ['```json\n{"a": 1}\n```', "{a: 1}"]),
    ("validate_repeat_prompt", {"original_prompt": "Write a haiku."}, "Write a haiku. Leaves fall.", ["Sure! Write a haiku."]),
    ("validate_two_responses", {}, "Answer A\n******\nAnswer B", ["Same\n******\nSame", "No separator", "a ****** b ****** c"]),
    ("validate_uppercase", {}, "HELLO WORLD 123!", ["HELLO World"]),
    ("validate_lowercase", {}, "hello world 123!", ["Hello world"]),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "at least"}, "NASA and ESA agree.", ["NASA only."]),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "at most"}, "NASA and ESA agree.", ["NASA ESA JAXA"]),
    ("validate_frequency_capital_words", {"N": 2, "quantifier": "around"}, "NASA and ESA", ["NASA ESA JAXA"]),  # exact, as run
    ("validate_end", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", ["Any other questions? Bye."]),
    ("validate_quotation", {}, '"All of it quoted."', ['Not "all" of it.', '"Open only.']),
    ("validate_no_commas", {}, "No commas here.", ["One, two."]),
]


@pytest.mark.parametrize(("name", "kwargs", "passes", "fails"), CASES, ids=[c[0] for c in CASES])
def test_each_check_passes_and_fails(name, kwargs, passes, fails):
    gt = truth(name, **kwargs)
    if passes is not None:
        assert ifeval(passes, gt) == 1.0
    for response in fails:
        assert ifeval(response, gt) == 0.0, response


def test_every_check_of_open_instruct_is_here_and_tested():
    assert len(CHECKS) == 25
    assert {c[0] for c in CASES} == set(CHECKS)


def test_the_text_the_checks_read():
    """open-instruct's remove_thinking_section: no "<|assistant|>", nothing up to the last </think>, no <answer> tags,
    stripped. A ground truth naming only its check gets the raw completion, as open-instruct passes it."""
    end = truth("validate_end", end_phrase="Bye.")
    assert ifeval("<think> I will say Bye. then go </think> Hello. Bye.\n\n", end) == 1.0
    assert ifeval("<answer>Hello. Bye.</answer>", end) == 1.0
    lower = truth("validate_lowercase")
    assert ifeval("<think>Plan It</think>all lowercase", lower) == 1.0  # the thinking is not checked
    quoted = '  "quoted"\n'
    assert ifeval(quoted, truth("validate_quotation")) == 1.0
    assert ifeval(quoted, json.dumps({"func_name": "validate_quotation"})) == 0.0  # the raw text: spaces around the quotes


def test_the_runs_two_bugs_are_fixed_and_replayable():
    """validate_placeholders returned (enough, found): the run's truthiness test passed every response.
    validate_choice tested `response in option`: only a response that is (part of) an option passed, and options
    stored as one string were read character by character."""
    placeholders = truth("validate_placeholders", N=3)
    assert ifeval("no placeholders at all", placeholders) == 0.0
    assert ifeval_as_run("no placeholders at all", placeholders) == 1.0
    choice = truth("validate_choice", options=YES_NO)
    assert (ifeval("I think so. My answer is yes.", choice), ifeval_as_run("I think so. My answer is yes.", choice)) == (1.0, 0.0)
    assert ifeval_as_run("My answer is yes.", choice) == 1.0  # the whole response is an option
    as_text = truth("validate_choice", options=str(tuple(YES_NO)))
    assert (ifeval("My answer is yes.", as_text), ifeval_as_run("My answer is yes.", as_text)) == (1.0, 0.0)
    assert ifeval_as_run("fine", truth("validate_lowercase")) == 1.0  # the other checks are the same
    replay = OpenInstructReward(verifiers=VERIFIERS | {"ifeval": ifeval_as_run})
    row = {"dataset": "ifeval"}
    assert replay(RewardContext("no placeholders", "", placeholders, row, "stop")) == (10.0, {"verified": 1.0})
    as_run = load_reward("actors.rewards:tulu3_as_run")  # the Tulu 3 recipe's
    assert as_run(RewardContext("no placeholders", "", placeholders, row, "stop")) == (10.0, {"verified": 1.0})
    assert open_instruct(RewardContext("no placeholders", "", placeholders, row, "stop")) == (0.0, {"verified": 0.0})


def test_a_bad_ground_truth_is_an_error_that_names_it():
    with pytest.raises(ValueError, match="no func_name"):
        ifeval("x", json.dumps({"N": 3}))
    with pytest.raises(ValueError, match="no IFEval check 'validate_haiku'"):
        ifeval("x", truth("validate_haiku"))
    with pytest.raises(ValueError, match="letter must be one character"):
        ifeval("x", truth("verify_letter_frequency", letter="ab", N=1))
    out = score_one(load_reward("actors.rewards:open_instruct"), RewardContext("x", "", truth("nope"), {"dataset": "ifeval"}, "stop"))
    assert out == Outcome(0.0, {}, "ValueError: no IFEval check 'nope'")


def test_a_tulu_row_end_to_end(tmp_path):
    """A row as allenai/RLVR-GSM-MATH-IF-Mixed-Constraints ships it, read by data.format = "open_instruct", scored by
    the built-in reward the Tulu 3 recipe names: 10 when the response follows the instruction, 0 when not, -10 when it
    did not stop (open-instruct's non_stop_penalty replaces the score)."""
    rows = [
        {
            "messages": [{"role": "user", "content": "Describe rain in 5 words at most."}],
            "ground_truth": truth("validate_word_constraint", N=5, quantifier="at most"),
            "dataset": "ifeval",
            "constraint_type": "Number Words",
            "constraint": "Answer with at most 5 words.",
        },
        {
            "messages": [{"role": "user", "content": "2+2"}],
            "ground_truth": "4",
            "dataset": "gsm8k",
            "constraint_type": None,
            "constraint": None,
        },
    ]
    path = tmp_path / "rlvr.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["data.task=file", f"data.path={path}", "data.format=open_instruct"])
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    (row, math_row) = read_rows(str(path), "data.path", cfg.data, tok, cfg.data.split)
    reward = load_reward("actors.rewards:open_instruct")

    def score(row, completion, finish_reason="stop"):
        return score_one(reward, RewardContext(completion, row.text, row.answer, parse_metadata(row.metadata), finish_reason))

    assert score(row, "Cold drops tap softly.") == Outcome(10.0, {"verified": 1.0})
    assert score(row, "Rain is water falling from the clouds above us.") == Outcome(0.0, {"verified": 0.0})
    assert score(row, "Cold drops tap softly.", "length") == Outcome(-10.0, {"verified": 1.0})
    assert score(math_row, "2 + 2 = 4") == Outcome(10.0, {"verified": 1.0})
