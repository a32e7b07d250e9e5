"""Format verifiers: `regex`, `think_format` and `answer_tag`.

- ``regex`` (options ``pattern``, ``fullmatch``, ``flags``): 1.0 if the pattern is found in the completion,
  else 0.0. Python's ``re`` has no timeout: keep recipe patterns simple (see `regex`).
- ``think_format`` (option ``prefilled``): 1.0 if the completion is ``<think>reasoning</think>`` followed by
  a non-empty answer, else 0.0.
- ``answer_tag`` (option ``case_sensitive``): the text of the last ``<answer>...</answer>`` compared with the
  `answer` column, as numbers or as normalised strings; no (closed) tag -> None.

    resolve("regex", options={"pattern": r"^Answer: \\d+$", "flags": "m"})
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from alignment.errors import UserError
from alignment.verifiers.numeric import numbers

_FLAG_LETTERS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


@lru_cache(maxsize=64)
def _compile(pattern: str, flags: str) -> re.Pattern:
    value = 0
    for letter in flags:
        value |= _FLAG_LETTERS[letter]
    return re.compile(pattern, value)


def regex(completion: str, *, pattern: str, fullmatch: bool = False, flags: str = "") -> float:
    """1.0 if `pattern` is found in the completion (or matches it whole), else 0.0.

    Options: ``pattern`` (required), ``fullmatch`` (default false), ``flags`` (letters of "imsx"). Never None: a
    format check has nothing to parse. Python's ``re`` has no timeout, so a pathological pattern can backtrack
    for a very long time on a long completion; keep recipe patterns simple (no nested quantifiers such as
    ``(a+)+``)."""
    compiled = _compile(pattern, flags)
    found = compiled.fullmatch(completion) if fullmatch else compiled.search(completion)
    return 1.0 if found else 0.0


def _check_regex(options: dict) -> None:
    pattern, flags = options.get("pattern"), options.get("flags", "")
    if not isinstance(pattern, str):
        raise UserError(f"Verifier 'regex': option pattern must be a string, got {pattern!r}.")
    if not isinstance(flags, str) or set(flags) - set(_FLAG_LETTERS):
        raise UserError(f"Verifier 'regex': option flags={flags!r} must be letters among 'imsx'.")
    try:
        _compile(pattern, flags)
    except re.error as exc:
        raise UserError(
            f"Verifier 'regex': option pattern {pattern!r} is not a valid regular expression: {exc}."
        ) from None


regex.check_options = _check_regex  # type: ignore[attr-defined]

_OPEN, _CLOSE = "<think>", "</think>"


def think_format(completion: str, *, prefilled: bool = False) -> float:
    """1.0 for '<think>...</think>answer' (one block, non-empty answer), else 0.0.

    Exactly one think block with nothing but whitespace before it; a missing block is "wrong format", not
    unparseable. With ``prefilled: true`` the opening ``<think>`` is part of the prompt (as in DeepSeek-R1
    style templates), so the completion must contain exactly one ``</think>`` and no ``<think>``."""
    if completion.count(_CLOSE) != 1:
        return 0.0
    head, answer = completion.split(_CLOSE)
    if prefilled:
        ok_head = _OPEN not in head and head.strip() != ""
    else:
        stripped = head.lstrip()
        ok_head = stripped.startswith(_OPEN) and head.count(_OPEN) == 1 and stripped[len(_OPEN) :].strip() != ""
    ok_answer = answer.strip() != "" and _OPEN not in answer
    return 1.0 if ok_head and ok_answer else 0.0


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_tag(completion: str) -> str | None:
    """Text of the last closed <answer>...</answer> tag, or None."""
    found = _ANSWER.findall(completion)
    return found[-1] if found else None


def _norm(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.casefold()


def answer_tag(completion: str, answer: Any, *, case_sensitive: bool = False) -> float | None:
    """Compare the last <answer> tag with the `answer` column; None if there is no tag.

    Equal as numbers if both are numbers (see `numeric`), else equal as strings after trimming, collapsing
    whitespace and (unless ``case_sensitive: true``) case-folding. A GSM8K gold solution is reduced to the
    text after ``####``. No (closed) tag -> None."""
    predicted = extract_tag(completion)
    if predicted is None:
        return None
    gold = str(answer)
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    gold_nums, pred_nums = numbers(gold), numbers(predicted)
    # numeric equality only when each side is exactly one number, so "3 apples" vs "3 pears" differ
    if len(gold_nums) == 1 and len(pred_nums) == 1 and _is_bare_number(gold) and _is_bare_number(predicted):
        return 1.0 if gold_nums[0] == pred_nums[0] else 0.0
    return 1.0 if _norm(predicted, case_sensitive) == _norm(gold, case_sensitive) else 0.0


def _is_bare_number(text: str) -> bool:
    return re.fullmatch(r"\s*[-+\u2212]?\$?\s?[\d,.\s/eE+-]+%?\s*\.?\s*", text) is not None
