"""`numeric` / `gsm8k` verifier: compare the completion's final number with the `answer` column.

``mode="lenient"`` (default): the first result after the last ``####`` marker (GSM8K style), else the last
``\\boxed{...}`` that holds a number, else the last number in the text; ``mode="strict"``: only the ``####``
marker counts. A number the completion only quotes (an operand, a number of the problem in a sentence copied
from it) is no answer: the rules, and what they do not cover, are `extract_answer`'s.

Numbers may carry thousands commas (1,234), a sign (also the Unicode minus), a ``$``, a trailing
``%`` (ignored: "25%" equals 25), decimals, an exponent (1e3) or be a fraction (3/4 == 0.75). A
trailing sentence period is not a decimal point. The `answer` column is a number or a string: a
GSM8K solution ending in ``#### 42`` or just "42". Equality is exact on rationals up to a relative
``tolerance`` (default 1e-6). Returns 1.0 (equal), 0.0 (different) or None (no answer found); a gold
answer without a number raises ValueError (an error row, not the model's fault).

    resolve("gsm8k").score("6 * 7 = 42\\n#### 42", {"answer": "... #### 42"}).reward  # 1.0
"""

from __future__ import annotations

import re
from fractions import Fraction
from numbers import Real
from typing import Any

from alignment.errors import UserError

MODES = ("lenient", "strict")

_NUMBER = re.compile(
    r"""
    (?<![\w.])                          # not glued to a word or to another number ("x2", "1.2.3")
    (?P<sign>[-+])?(?:\$\s?)?(?P<sign2>[-+])?  # "-$5", "$-5", "$ 5"; "5 - 3" is not -3
    (?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)? | \.\d+)
    (?:\s?/\s?(?P<den>\d+)(?!\.\d))?   # fraction 3/4; "3/4." ends a sentence, "3/4.5" is no fraction
    """,
    re.VERBOSE,
)
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
# an arithmetic operator after an operand-like character: "37 + " but not a "- " list bullet
_OPERATOR = r"(?:[-+*/\u00d7\u00f7\u00b7^]|\\times|\\cdot|\\div)"
_OPERATOR_BEFORE = re.compile(rf"[\w)}}\]][ \t]*{_OPERATOR}[ \t]*\$?[ \t]*$")
_OPERATOR_AFTER = re.compile(rf"[ \t]*{_OPERATOR}[ \t]*\$?[ \t]*[-+]?[\d.]")
_STATED_AS_RESULT = re.compile(r"(?:[=:]|\b(?:is|are|was|equals))\s*\$?\s*$", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
# a closing aside that shows the calculation: "so 85 (37 + 48)."
_CLOSING_ASIDE = re.compile(rf"\((?=[^()]*{_OPERATOR})[^()]*\)[\s.!?]*$")
# Columns that may hold the problem: GSM8K's `question`, MATH's `problem`, the RL stages' `prompt`.
PROBLEM_COLUMNS = ("question", "problem", "prompt")


def _normalize(text: str) -> str:
    # LaTeX and typography spellings of the same characters
    return (
        text.replace("\u2212", "-")  # Unicode minus
        .replace("{,}", ",")  # LaTeX thousands separator 1{,}234
        .replace("\\$", "$")
        .replace("\\%", "%")
        .replace("\\!", "")
    )


def _value(match: re.Match) -> Fraction | None:
    sign = -1 if "-" in ((match["sign"] or "") + (match["sign2"] or "")) else 1
    value = Fraction(match["num"].replace(",", ""))
    if match["den"] is not None:
        if int(match["den"]) == 0:
            return None
        value /= int(match["den"])
    return sign * value


def numbers(text: str) -> list[Fraction | None]:
    """All numbers in `text`, in order (None for an undefined one such as 3/0)."""
    return [_value(m) for m in _NUMBER.finditer(_normalize(text))]


def problem_text(*columns: Any) -> str:
    """The problem as plain text from the columns that may hold it: strings, or chat messages (only
    the user's turns: a system prompt's numbers are not the problem's)."""
    parts = []
    for column in columns:
        if isinstance(column, str):
            parts.append(column)
        elif isinstance(column, (list, tuple)):
            parts += [str(m.get("content", "")) for m in column if isinstance(m, dict) and m.get("role") == "user"]
    return "\n".join(parts)


def _is_operand(text: str, match: re.Match) -> bool:
    """Whether the number is an operand of a calculation ("37 + 48", "37 +"), not a stated result."""
    return bool(_OPERATOR_BEFORE.search(text[: match.start()]) or _OPERATOR_AFTER.match(text[match.end() :]))


def _squash(text: str) -> str:
    """Lower case, single spaces, no spaces around symbols, no closing punctuation: for "is copied"."""
    text = re.sub(r"\s+", " ", text.lower())
    return re.sub(r"\s*([^\w\s])\s*", r"\1", text).strip(" .!?")


def _quotes_problem(text: str, match: re.Match, problem: str) -> bool:
    """Whether the last number `match` only quotes the problem (rules in `extract_answer`)."""
    if _value(match) not in numbers(problem):
        return False
    start = max((m.end() for m in _SENTENCE_END.finditer(text, 0, match.start())), default=0)
    statement = _squash(text[start:])
    if statement == _squash(match.group()):
        return False  # the statement is the bare number: an answer even when the problem holds it
    if statement in _squash(problem):
        return True
    unfinished = not _SENTENCE_END.search(text, match.end())
    return unfinished and not _STATED_AS_RESULT.search(text[start : match.start()])


def _first_result(text: str) -> Fraction | None:
    """The first number in `text` that is not an operand ("37 + 48 = 85" -> 85)."""
    for match in _NUMBER.finditer(text):
        if not _is_operand(text, match):
            return _value(match)
    return None


def _last_number(text: str, problem: str) -> Fraction | None:
    """The last number in `text` when it is an answer: not an operand, not quoted from the problem.
    A closing aside that shows the calculation is not where the answer is ("85 (37 + 48)." is 85)."""
    text = _CLOSING_ASIDE.sub("", text)
    matches = list(_NUMBER.finditer(text))
    if not matches or _OPERATOR_BEFORE.search(text[: matches[-1].start()]):
        return None
    if problem and _quotes_problem(text, matches[-1], problem):
        return None
    return _value(matches[-1])


def extract_answer(completion: str, mode: str = "lenient", problem: str = "") -> Fraction | None:
    """The completion's final answer as an exact Fraction, or None if there is none. `problem`
    (plain text, see `problem_text`) lets the last-number rule pass over numbers quoted from it.

    Which number counts as the completion's answer:

    - ``mode="lenient"`` (default): the first result after the last ``####`` marker (GSM8K style); if
      there is no marker, the last ``\\boxed{...}`` that holds a number; else the last number in the text.
      A marker with no number after it is unparseable (the model chose the format and broke it).
    - ``mode="strict"``: only the ``####`` marker counts; without it the completion is unparseable.

    A number the completion only quotes is not an answer, because RL pays for whatever this function
    reads and a policy learns to copy the question when that pays. So, returning None:

    - an operand: a number right after an arithmetic operator (``37 + 48``, ``9 * 2``, ``2^10``) is part
      of an unfinished calculation, not its result; after ``####`` the first number that is not an
      operand counts (``#### 37 + 48 = 85`` is 85, ``#### 37 + 48`` is nothing); a closing aside in
      parentheses that shows the calculation is passed over ("so 85 (37 + 48)." is 85);
    - with the problem at hand (the ``question``, ``problem`` or ``prompt`` column, whichever the row
      has), a last number that also occurs in the problem is no answer when its final statement is
      copied from the problem ("Janet's ducks lay 16 eggs per day.") or is cut off mid-sentence ("She
      sells them for $2") without stating it as a result: nothing closes the sentence (no ``.``, ``!``,
      ``?`` or line break after the number) and no ``=``, ``:``, "is", "are", "was" or "equals" comes
      right before it. A final statement that is just the number ("16") is an answer.

    Not covered: a finished sentence in the model's own words that ends in a number of the problem ("She
    has 5 apples left.") counts, as it must when the answer is 5, so guessing a number of the problem
    still pays on problems whose answer is one; without a problem column only the operand rule applies.
    Use ``mode="strict"`` where only a deliberate ``#### N`` may pay."""
    text = _normalize(completion)
    if "####" in text:
        return _first_result(text.rsplit("####", 1)[1])
    if mode == "strict":
        return None
    for boxed in reversed(_BOXED.findall(text)):
        found = numbers(boxed)
        if found:
            return found[-1]
    return _last_number(text, _normalize(problem))


def parse_gold(answer: Any) -> Fraction:
    """The reference answer as a Fraction; ValueError if the column holds no number."""
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"answer column is {answer!r}, expected a number or a string with one")
    if isinstance(answer, Real):
        return Fraction(answer)  # floats convert exactly; the tolerance absorbs binary noise
    text = str(answer)
    value = extract_answer(text, "lenient")
    if value is None:
        raise ValueError(f"answer column {text[:80]!r} contains no number")
    return value


def verify(
    completion: str,
    answer: Any,
    question: Any = None,
    problem: Any = None,
    prompt: Any = None,
    *,
    mode: str = "lenient",
    tolerance: float = 1e-6,
) -> float | None:
    """1.0 if the completion's final number equals `answer`, 0.0 if not, None if it has none.
    `question`/`problem`/`prompt` (whichever the row has) hold the problem, whose numbers a
    completion may quote without answering."""
    gold = parse_gold(answer)
    predicted = extract_answer(completion, mode, problem_text(question, problem, prompt))
    if predicted is None:
        return None
    tol = Fraction(str(tolerance))
    return 1.0 if abs(predicted - gold) <= tol * max(1, abs(gold)) else 0.0


def check_options(options: dict) -> None:
    """Called by resolve(): reject a bad mode or tolerance at load time."""
    mode = options.get("mode", "lenient")
    if mode not in MODES:
        raise UserError(f"Verifier 'numeric': option mode={mode!r} is not one of {', '.join(MODES)}.")
    tol = options.get("tolerance", 0.0)
    if isinstance(tol, bool) or not isinstance(tol, Real) or tol < 0:
        raise UserError(f"Verifier 'numeric': option tolerance={tol!r} must be a number >= 0.")


verify.check_options = check_options  # type: ignore[attr-defined]
