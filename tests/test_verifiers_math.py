"""Table-driven tests for the `math` verifier (math-verify), including calls from a thread."""

import threading
import time

import pytest

from alignment.errors import UserError
from alignment.verifiers import math_answer, resolve
from alignment.verifiers.math_answer import verify

# (completion, answer column, expected reward or None)
CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("$\\boxed{x^2+2x+1}$", "(x+1)^2", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{[1,2]}", "[1,2]", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("The answer is 3/4", "0.75", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("So x = 3", 3, 1.0),  # numeric gold column
    ("The answer is 7", "Some reasoning.\n#### 7", 1.0),  # GSM8K gold
    ("\\boxed{x=2}", "2", 1.0),
    ("\\boxed{-1}", "1", 0.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("First I guessed 5 but the answer is \\boxed{6}", "6", 1.0),  # boxed has priority
    # unparseable: nothing mathematical in the completion
    ("no math here", "3", None),
    ("", "3", None),
    ("\\boxed{}", "1", None),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), CASES)
def test_math_table(completion, answer, expected):
    assert verify(completion, answer) == expected


def test_bad_gold_is_an_error_row():
    result = resolve("math").score("\\boxed{1}", {"answer": ""})
    assert result.status == "error" and "answer column" in result.detail


def test_from_a_non_main_thread():
    """signal.alarm only works in the main thread; off it the check runs in a worker process."""
    v = resolve("math")
    results = {}

    def work(i, completion, answer):
        results[i] = v.score(completion, {"answer": answer})

    threads = [
        threading.Thread(target=work, args=(0, "\\boxed{\\frac{1}{2}}", "0.5")),
        threading.Thread(target=work, args=(1, "\\boxed{3}", "4")),
        threading.Thread(target=work, args=(2, "nothing", "4")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i].reward for i in range(3)] == [1.0, 0.0, 0.0]
    assert [results[i].status for i in range(3)] == ["ok", "ok", "unparseable"]


def test_worker_timeout_kills_and_restarts_the_worker():
    assert math_answer.run_in_worker(abs, (-2,), timeout=30) == 2  # warm: spawning takes a while
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        math_answer.run_in_worker(time.sleep, (30,), timeout=1)
    assert time.monotonic() - start < 5
    assert math_answer.run_in_worker(abs, (-3,), timeout=30) == 3  # a fresh worker answers


def test_timeout_option_is_validated():
    with pytest.raises(UserError, match="timeout"):
        resolve("math", options={"timeout": 0})
    assert resolve("math", options={"timeout": 2}).options == {"timeout": 2}
