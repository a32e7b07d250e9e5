"""Table-driven tests for the `numeric` / `gsm8k` verifier."""

from fractions import Fraction

import pytest

from alignment.errors import UserError
from alignment.verifiers import resolve
from alignment.verifiers.numeric import extract_answer, verify

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
)

# (completion, answer column, mode, expected reward or None)
CASES = [
    ("#### 42", 42, "lenient", 1.0),
    ("6 * 7 = 42", "#### 42", "lenient", 1.0),  # gold is a GSM8K solution
    ("She sold 72 clips in total.", GSM8K_GOLD, "lenient", 1.0),
    ("She sold 71 clips.", GSM8K_GOLD, "lenient", 0.0),
    ("The total is $1,234.", 1234, "lenient", 1.0),  # dollar, thousands comma, sentence period
    ("It costs $ 12.50", 12.5, "lenient", 1.0),
    ("The temperature is -5 degrees", -5, "lenient", 1.0),
    ("x = \u22127", "-7", "lenient", 1.0),  # Unicode minus
    ("Three quarters: 3/4", 0.75, "lenient", 1.0),  # fraction vs decimal
    ("0.75", "3/4", "lenient", 1.0),
    ("The rate is 25%", 25, "lenient", 1.0),
    ("42.0", "42", "lenient", 1.0),
    ("1e3 grams", 1000, "lenient", 1.0),
    ("12 apples and 5 oranges", 5, "lenient", 1.0),  # the last number counts
    ("12 apples and 5 oranges", 12, "lenient", 0.0),
    ("The answer is 42. Wait, no: 43", 42, "lenient", 0.0),
    ("#### 42\nThen 43 more words 44", 42, "lenient", 1.0),  # the marker wins
    ("#### 41", 42, "lenient", 0.0),
    ("We get \\boxed{8}. Check: 8 - 3 = 5", 8, "lenient", 1.0),  # boxed beats the last number
    ("1{,}234", 1234, "lenient", 1.0),  # LaTeX thousands separator
    ("5 - 3 = 2", 2, "lenient", 1.0),  # '- 3' is subtraction, not -3
    ("0.1 + 0.2", 0.30000000000000004, "lenient", None),  # 0.2 is an operand: the sum states no result
    ("0.3", 0.1 + 0.2, "lenient", 1.0),  # float noise in the gold is tolerated
    # unparseable
    ("I have no idea", 42, "lenient", None),
    ("", 42, "lenient", None),
    ("#### ", 42, "lenient", None),  # marker, then nothing
    ("#### unknown", 42, "lenient", None),
    ("3/0", 1, "lenient", None),
    # strict mode needs the marker
    ("The answer is 42", 42, "strict", None),
    ("#### 42", 42, "strict", 1.0),
    ("#### 1,000,000", 10**6, "strict", 1.0),
    ("#### -3.5", "-7/2", "strict", 1.0),
]


@pytest.mark.parametrize(("completion", "answer", "mode", "expected"), CASES)
def test_numeric_table(completion, answer, mode, expected):
    assert verify(completion, answer, mode=mode) == expected


@pytest.mark.parametrize("key", ["numeric", "gsm8k"])
def test_resolved_verifier_reports_status(key):
    v = resolve(key)
    assert v.score("#### 72", {"answer": GSM8K_GOLD, "question": "ignored"}).status == "ok"
    assert v.score("no number", {"answer": "72"}).status == "unparseable"
    assert v.score("#### 72", {"answer": "n/a"}).status == "error"  # bad gold: not the model's fault


def test_extract_answer_is_exact():
    assert extract_answer("about 1/3 of it") == Fraction(1, 3)
    assert extract_answer("version 1.2.3 has 7 bugs") == 7


def test_bad_options_fail_at_resolve():
    with pytest.raises(UserError, match="mode"):
        resolve("numeric", options={"mode": "fuzzy"})
    with pytest.raises(UserError, match="tolerance"):
        resolve("numeric", options={"tolerance": -1})
    assert resolve("numeric", options={"mode": "strict"}).score("42", {"answer": 42}).status == "unparseable"
