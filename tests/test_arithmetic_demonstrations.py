"""The arithmetic task's imperfect demonstrations (`carry_mistake_rate`): what the quickstart's SFT imitates."""

from __future__ import annotations

from alignment.config.tasks import ArithmeticParams
from alignment.tasks import arithmetic


def operands(row: dict) -> tuple[int, int]:
    a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split("+")
    return int(a), int(b)


def test_only_carrying_sums_are_demonstrated_with_the_carry_dropped_and_everything_else_stays_right():
    rows = arithmetic.build(ArithmeticParams(n=3000, carry_mistake_rate=0.6), "train", seed=5)
    carrying = [r for r in rows if arithmetic.carries(operands(r)[0], "+", operands(r)[1])]
    wrong = [r for r in rows if r["completion"] != r["answer"]]
    assert 1000 < len(carrying) < 1700  # 45% of 2-digit pairs carry out of the units digit
    for row in wrong:
        a, b = operands(row)
        assert arithmetic.carries(a, "+", b) and int(row["completion"]) == a + b - 10  # 37+48 -> 75
    assert 0.55 < len(wrong) / len(carrying) < 0.65
    for row in rows:  # what the verifier, RL and the preference pairs see is the right answer
        assert int(row["answer"]) == sum(operands(row)) and row["chosen"] == row["answer"]
        assert arithmetic.verify(row["completion"], row["answer"]) == (1.0 if row not in wrong else 0.0)


def test_the_messages_format_demonstrates_the_same_answers():
    plain = arithmetic.build(ArithmeticParams(n=500, carry_mistake_rate=1.0), "train", seed=2)
    chat = arithmetic.build(ArithmeticParams(n=500, carry_mistake_rate=1.0, format="messages"), "train", seed=2)
    assert [r["messages"][-1]["content"] for r in chat] == [r["completion"] for r in plain]
    assert any(r["completion"] != r["answer"] for r in plain)


def test_without_a_mistake_rate_the_rows_are_unchanged():
    # The rate draws from the row generator only when it is set: other recipes' data stays bit-identical.
    rows = arithmetic.build(ArithmeticParams(n=400), "train", seed=3)
    assert all(r["completion"] == r["answer"] for r in rows)
    assert rows == arithmetic.build(ArithmeticParams(n=400, carry_mistake_rate=0.0), "train", seed=3)
