"""open-instruct's IFEval verifier as Tulu 3 RLVR ran it (allenai/open-instruct: ground_truth_utils.py
`IFEvalVerifierOld`, and the 25 checks of open_instruct/if_functions.py as of the run).

A row's ground truth (allenai/RLVR-GSM-MATH-IF-Mixed-Constraints, `dataset` "ifeval") is a JSON object naming one
check and its arguments, every argument listed and null where unused:
    {"func_name": "validate_word_constraint", "N": 100, "quantifier": "at least", "keyword_list": null, ...}
The check is called with the non-null arguments and scores 1 (passed) or 0.

The text checked: the completion without a "<|assistant|>" marker, without anything up to its last "</think>" and
without <answer> tags, stripped (`response_text`). A ground truth naming only the check gets the raw completion,
as open-instruct passes it (RLVR rows list every argument, so they get the stripped text).

Two bugs of the checks as run, fixed here (`ifeval`), kept in `ifeval_as_run` for a faithful replay:
- validate_placeholders returned the pair (enough, found). The run's caller tested the result for truth, and a
  non-empty pair is true: every response passed (float() of it, as the later IFEvalVerifierOld does, would raise).
  Fixed: at least N "[...]" placeholders.
- validate_choice tested `response in option` (the response inside an option): a real answer never passed.
  Fixed: some option occurs in the response (later open-instruct does the same). Options given as a string (a
  Python or JSON list literal, as the dataset may store them) are parsed first, not read character by character.
Later upstream changes that are not bugs are not taken, since the run did not have them: sentences also ending at
"!", sections counted by numbered headers, capital-word "around" within 10%.

Departures: a ground truth without `func_name`, or naming an unknown check, is an error that names it (open-instruct
logs a warning and scores 0, or raises on an unknown name): the reward counts it and scores 0. The language check
seeds langdetect (same text, same verdict) and fails text langdetect cannot read; open-instruct's is unseeded and
raises there.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[..., bool]


def response_text(completion: str) -> str:
    """What the checks read (open-instruct's remove_thinking_section)."""
    text = completion.replace("<|assistant|>", "").strip()
    text = text.rpartition("</think>")[2]
    return text.replace("<answer>", "").replace("</answer>", "").strip()


def ifeval(response: str, ground_truth: str, checks: Mapping[str, Check] | None = None) -> float:
    """1 when the response passes the check the ground truth names, else 0; ValueError for a ground truth that
    names none or an unknown one. `checks` defaults to CHECKS (the bugs fixed)."""
    table = CHECKS if checks is None else checks
    spec = json.loads(ground_truth)
    if not isinstance(spec, dict):
        raise ValueError(f"the IFEval ground truth is a JSON {type(spec).__name__}, not an object with func_name")
    name = spec.pop("func_name", None)
    if name is None:
        raise ValueError(f"the IFEval ground truth has no func_name: {ground_truth[:200]}")
    check = table.get(name)
    if check is None:
        raise ValueError(f"no IFEval check {name!r}")
    kwargs = {k: v for k, v in spec.items() if v is not None}
    text = response_text(response) if spec else response
    return 1.0 if check(text, **kwargs) else 0.0


def ifeval_as_run(response: str, ground_truth: str) -> float:
    """`ifeval` with the two bugs of the Tulu 3 run (module docstring)."""
    return ifeval(response, ground_truth, AS_RUN_CHECKS)


# ---- the checks, named as the ground truth names them; each docstring is the instruction it verifies ----


def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    """Include keywords {keyword_list}: each occurs, ignoring case (as substrings)."""
    lowered = text.lower()
    return all(k.lower() in lowered for k in keyword_list)


def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    """The word {word} should appear {N} times: exactly N of the response's words are it, ignoring case."""
    return sum(w == word.lower() for w in re.findall(r"\w+", text.lower())) == N


def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    """Do not include keywords {forbidden_words}: none occurs, ignoring case (as substrings)."""
    lowered = text.lower()
    return not any(w.lower() in lowered for w in forbidden_words)


def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    """The letter {letter} should appear {N} times: exactly N, case-sensitive."""
    if len(letter) != 1:
        raise ValueError(f"letter must be one character, got {letter!r}")
    return text.count(letter) == N


def validate_response_language(text: str, language: str) -> bool:
    """Your entire response should be in {language}: langdetect's guess is that ISO code."""
    from langdetect import DetectorFactory, LangDetectException, detect

    DetectorFactory.seed = 0  # langdetect samples: unseeded, the same text may get another verdict next time
    try:
        return detect(text) == language
    except LangDetectException:  # no letters to read (digits, symbols, nothing)
        return False


def verify_paragraph_count(text: str, N: int) -> bool:
    """{N} paragraphs separated by the markdown divider * * *: exactly N, none empty (lines stripped first)."""
    cleaned = "\n".join(line.strip() for line in text.splitlines()).strip()
    parts = cleaned.split("* * *")
    return len(parts) == N and all(p.strip() for p in parts)


def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    """Answer with at least / around / at most {N} words (split on whitespace; "around": within 10%, at least 1)."""
    return _quantified(len(text.split()), N, quantifier, tolerance=max(round(N * 0.1), 1))


# A sentence ends at "." or "?" followed by whitespace, unless it closes an abbreviation like "e.g." or "Mr.".
_SENTENCE_END = re.compile(r"(?<!\w\.\w.)(?<![A-Z][a-z]\.)(?<=[.?])\s")


def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    """Answer with at least / around / at most {N} sentences ("around": within 1)."""
    return _quantified(len(_SENTENCE_END.split(text)), N, quantifier, tolerance=1)


def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    """{N} paragraphs separated by blank lines ("\\n\\n"); the {i}-th (from 1) starts with {first_word}."""
    parts = text.split("\n\n")
    return len(parts) == N and 0 < i <= N and parts[i - 1].strip().startswith(first_word)


def verify_postscript(text: str, postscript_marker: str) -> bool:
    """Add a postscript starting with {postscript_marker}: the marker occurs and something follows it."""
    at = text.find(postscript_marker)
    return at >= 0 and len(text[at:].strip()) > len(postscript_marker)


def validate_placeholders(text: str, N: int) -> bool:
    """At least {N} placeholders in square brackets, such as [address]."""
    return len(re.findall(r"\[.*?\]", text)) >= N


def verify_bullet_points(text: str, N: int) -> bool:
    """Exactly {N} markdown bullet points: lines starting (after spaces) with "*" or "-"."""
    return sum(line.strip().startswith(("*", "-")) for line in text.split("\n")) == N


def validate_title(text: str) -> bool:
    """A title wrapped in double angular brackets, such as <<poem of joy>> (on one line)."""
    return re.search(r"<<.*?>>", text) is not None


def validate_choice(text: str, options: list[str] | str) -> bool:
    """Answer with one of the following options: {options}: one of them occurs in the response."""
    return any(option in text for option in _option_list(options))


def validate_highlighted_sections(text: str, N: int) -> bool:
    """Highlight at least {N} sections with markdown, i.e. *highlighted section* (pairs of "*", "**" counting)."""
    return len(re.findall(r"\*.*?\*", text)) >= N


def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    """{N} sections, each beginning with {section_splitter} X: exactly N pieces between splitters (text before the
    first splitter counts as one unless empty)."""
    parts = text.split(section_splitter)
    if parts[0] == "":
        parts = parts[1:]
    return len(parts) == N


def validate_json_format(text: str) -> bool:
    """The entire output wrapped in JSON: it parses as JSON (a ```json fence does not)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    """First repeat the request without change: the response starts with it."""
    return text.startswith(original_prompt)


def validate_two_responses(text: str) -> bool:
    """Two different responses separated by six asterisks ******: one separator, the halves differ."""
    if text.count("******") != 1:
        return False
    first, second = text.split("******")
    return first.strip() != second.strip()


def validate_uppercase(text: str) -> bool:
    """Your entire response in capital letters: nothing changes when upper-cased."""
    return text == text.upper()


def validate_lowercase(text: str) -> bool:
    """Your entire response in lowercase letters: nothing changes when lower-cased."""
    return text == text.lower()


def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    """Words in all capital letters at least / around / at most {N} times ("around": exactly N, as run)."""
    return _quantified(len(re.findall(r"\b[A-Z]+\b", text)), N, quantifier, tolerance=0)


def validate_end(text: str, end_phrase: str) -> bool:
    """Finish your response with this exact phrase {end_phrase}."""
    return text.endswith(end_phrase)


def validate_quotation(text: str) -> bool:
    """Wrap your entire response with double quotation marks."""
    return text.startswith('"') and text.endswith('"')


def validate_no_commas(text: str) -> bool:
    """Refrain from the use of any commas."""
    return "," not in text


def _quantified(count: int, N: int, quantifier: str, tolerance: int) -> bool:
    if quantifier == "at least":
        return count >= N
    if quantifier == "at most":
        return count <= N
    if quantifier == "around":
        return abs(count - N) <= tolerance
    return False  # open-instruct: any other quantifier fails the check


def _option_list(options: Any) -> list[str]:
    if isinstance(options, str):
        try:
            parsed = ast.literal_eval(options)
        except (ValueError, SyntaxError):
            return [options]
        if isinstance(parsed, list | tuple) and all(isinstance(o, str) for o in parsed):
            return list(parsed)
        return [options]
    return [str(o) for o in options]


def _placeholders_as_run(text: str, N: int) -> bool:
    """The run's validate_placeholders: its (enough, found) pair was always true (module docstring)."""
    return True


def _choice_as_run(text: str, options: Any) -> bool:
    """The run's validate_choice: the response inside an option; options iterated as given (a string: its characters)."""
    return any(text in option for option in options)


CHECKS: dict[str, Check] = {
    f.__name__: f
    for f in (
        verify_keywords,
        verify_keyword_frequency,
        validate_forbidden_words,
        verify_letter_frequency,
        validate_response_language,
        verify_paragraph_count,
        validate_word_constraint,
        verify_sentence_constraint,
        validate_paragraphs,
        verify_postscript,
        validate_placeholders,
        verify_bullet_points,
        validate_title,
        validate_choice,
        validate_highlighted_sections,
        validate_sections,
        validate_json_format,
        validate_repeat_prompt,
        validate_two_responses,
        validate_uppercase,
        validate_lowercase,
        validate_frequency_capital_words,
        validate_end,
        validate_quotation,
        validate_no_commas,
    )
}
AS_RUN_CHECKS: dict[str, Check] = CHECKS | {"validate_placeholders": _placeholders_as_run, "validate_choice": _choice_as_run}
