"""`numeric` / `gsm8k` verifier: compare the completion's final number with the `answer` column.

Which number counts as the completion's answer:

- ``mode="lenient"`` (default): the first number after the last ``####`` marker (GSM8K style); if
  there is no marker, the last ``\\boxed{...}`` that holds a number; else the last number in the text.
  A marker with no number after it is unparseable (the model chose the format and broke it).
- ``mode="strict"``: only the ``####`` marker counts; without it the completion is unparseable.

Numbers may carry thousands commas (1,234), a sign (also the Unicode minus), a ``$``, a trailing
``%`` (ignored: "25%" equals 25), decimals, an exponent (1e3) or be a fraction (3/4 == 0.75). A
trailing sentence period is not a decimal point. The `answer` column is a number or a string: a
GSM8K solution ending in ``#### 42`` or just "42". Equality is exact on rationals up to a relative
``tolerance`` (default 1e-6) so 0.1+0.2-style float noise in a gold column still matches.

Returns 1.0 (equal), 0.0 (different) or None (no number found). A gold answer without a number
raises ValueError, which the Verifier reports as an error row, not as the model's fault.

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


def extract_answer(completion: str, mode: str = "lenient") -> Fraction | None:
    """The completion's final answer as an exact Fraction, or None if there is none."""
    text = _normalize(completion)
    if "####" in text:
        found = numbers(text.rsplit("####", 1)[1])
        return found[0] if found else None
    if mode == "strict":
        return None
    for boxed in reversed(_BOXED.findall(text)):
        found = numbers(boxed)
        if found:
            return found[-1]
    found = numbers(text)
    return found[-1] if found else None


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


def verify(completion: str, answer: Any, *, mode: str = "lenient", tolerance: float = 1e-6) -> float | None:
    """1.0 if the completion's final number equals `answer`, 0.0 if not, None if it has none."""
    gold = parse_gold(answer)
    predicted = extract_answer(completion, mode)
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
