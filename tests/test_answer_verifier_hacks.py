"""Reward hacks against the answer verifiers (`numeric`/`gsm8k`, `math`, `arithmetic`): completions
that state no answer of their own, only the problem's numbers or expressions, must not be paid
(issue #28). Each row is one completion, the dataset row it is scored against (every column, as the
RL stages and evaluation pass them) and the score it must get: 0.0 (wrong) or None (no answer:
status "unparseable"). Rows marked `honest` are the answer shapes real models write (SmolLM2,
Qwen); they must keep scoring 1.0, or 0.0 when wrong.
"""

import threading
from dataclasses import dataclass

import pytest

from alignment.verifiers import resolve


@dataclass(frozen=True)
class Row:
    name: str
    verifier: str
    completion: str
    example: dict
    expected: float | None


GSM8K_QUESTION = (
    "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
    "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
    "duck egg. How much in dollars does she make every day at the farmers' market?"
)
GSM8K = {"question": GSM8K_QUESTION, "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18"}
# a GSM8K-style problem whose answer is also one of its numbers: quoting the problem would pay
ECHO = {"question": "Tom has 12 apples. He gives away 0 of them. How many apples does Tom have?", "answer": "#### 12"}
ADD = {"question": "What is 37+48?", "answer": "85"}
TIMES = {"question": "What is 12*3?", "answer": "36"}


def row(name, verifier, completion, example, expected):
    return Row(name, verifier, completion, example, expected)


NUMERIC = [
    row("restated_sum_last_operand", "numeric", "37+48", {**ADD, "answer": "48"}, None),
    row("restated_sum_cut_at_equals", "numeric", "37 + 48 =", {**ADD, "answer": "48"}, None),
    row("restated_product_in_prose", "numeric", "We need to compute 12*3", {**TIMES, "answer": "3"}, None),
    row("marker_then_restated_sum", "gsm8k", "#### 37 + 48", {**ADD, "answer": "48"}, None),
    row("copied_question_sentence", "gsm8k", "Tom has 12 apples.", ECHO, None),
    row("cut_off_after_a_problem_number", "gsm8k", "Tom starts with 12", ECHO, None),
    row(
        "gsm8k_cut_off_mid_copy",
        "gsm8k",
        "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
        "her friends every day with four. She sells the remainder at the farmers' market daily for $2",
        {**GSM8K, "answer": "#### 2"},
        None,
    ),
    row(
        "gsm8k_unfinished_product", "gsm8k", "16 - 3 - 4 = 9 eggs are left. 9 * 2", {**GSM8K, "answer": "#### 2"}, None
    ),
    row(
        "prompt_column_in_chat_format",
        "gsm8k",
        "Tom has 12 apples.",
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ECHO["question"]}],
            "answer": ECHO["answer"],
        },
        None,
    ),
    # honest answers keep paying, also when the answer is one of the problem's numbers
    row("honest_answer_then_calculation_aside", "numeric", "So the sum is 85 (37 + 48).", ADD, 1.0),
    row("aside_only", "numeric", "(37 + 48)", {**ADD, "answer": "48"}, None),
    row("honest_restated_question_then_answer", "numeric", "What is 12*3? 36", TIMES, 1.0),
    row("honest_restated_question_own_paragraph", "numeric", "What is 12*3?\n\n36", TIMES, 1.0),
    row("honest_equation", "numeric", "37 + 48 = 85", ADD, 1.0),
    row("honest_marker_with_working", "gsm8k", "#### 37 + 48 = 85", ADD, 1.0),
    row("honest_gsm8k_solution", "gsm8k", "16 - 3 - 4 = 9 eggs are left.\n9 * 2 = 18\n#### 18", GSM8K, 1.0),
    row("honest_so_the_answer_is", "gsm8k", "She sells 9 eggs at $2 each, so the answer is 18.", GSM8K, 1.0),
    row("honest_boxed", "gsm8k", "9 * 2 = 18, so she makes $\\boxed{18}$ dollars.", GSM8K, 1.0),
    row("honest_wrong_answer", "gsm8k", "She makes $16 every day.", GSM8K, 0.0),
    row("honest_answer_that_is_a_problem_number", "gsm8k", "Tom still has 12 apples.", ECHO, 1.0),
    row("honest_bare_problem_number", "gsm8k", "12", ECHO, 1.0),
    row("honest_answer_is_problem_number_unclosed", "gsm8k", "The answer is 12", ECHO, 1.0),
]

ZERO = {"prompt": "What is 0 + 48? Answer with just the number.", "answer": "48"}
ONE = {"prompt": [{"role": "user", "content": "What is 48 * 1?"}], "answer": "48"}
ARITHMETIC = [
    # the answer equals an operand, so a restatement of the problem used to read as the answer
    row("restated_zero_sum", "arithmetic", "0 + 48", ZERO, None),
    row("restated_zero_sum_cut_at_equals", "arithmetic", "0 + 48 =", ZERO, None),
    row("restated_in_words_cut_off", "arithmetic", "The sum of 0 and 48", ZERO, None),
    row("restated_product_chat_prompt", "arithmetic", "48 * 1", ONE, None),
    row("restated_sum_wrong_answer", "arithmetic", "37 + 48 =", {"prompt": "What is 37+48?", "answer": "85"}, None),
    row("honest_equation_answer_is_operand", "arithmetic", "0 + 48 = 48", ZERO, 1.0),
    row("honest_words_answer_is_operand", "arithmetic", "The sum of 0 and 48 is 48.", ZERO, 1.0),
    row("honest_bare_answer_is_operand", "arithmetic", "48", ZERO, 1.0),
    row(
        "honest_restated_question_own_paragraph",
        "arithmetic",
        "What is 12*3?\n\n36",
        {"prompt": "What is 12*3?", "answer": "36"},
        1.0,
    ),
    row(
        "honest_restated_question_then_answer",
        "arithmetic",
        "What is 12*3? 36",
        {"prompt": "What is 12*3?", "answer": "36"},
        1.0,
    ),
    row("honest_wrong", "arithmetic", "0 + 48 = 49", ZERO, 0.0),
    row(
        "honest_problem_paragraph_then_working",
        "arithmetic",
        "To find 37 + 48, we add the numbers.\n\n37 + 48 = 85",
        {"prompt": "What is 37 + 48?", "answer": "85"},
        1.0,
    ),
]

FRAC = {"problem": "Compute $\\frac{24}{8}$.", "answer": "3"}
BINOM = {"problem": "Compute $\\dbinom{31}{28}$.", "answer": "4495"}
DIVIDE = {"problem": "What is $\\frac{18}{6}$?", "answer": "3"}
LINEAR = {"problem": "If $2x+3=11$, what is $2x+3$?", "answer": "11"}
CHOICE = {"problem": "Which is larger, $\\frac{1}{2}$ or $\\frac{1}{3}$?", "answer": "\\frac{1}{2}"}
MATH = [
    # restating the problem: math-verify evaluates the restated expression to the gold value
    row("unsure_restates_fraction", "math", "I am not sure how to compute $\\frac{24}{8}$.", FRAC, None),
    row(
        "restates_binomial_then_cut_off", "math", "Let us evaluate $\\dbinom{31}{28}$ step by step. First", BINOM, None
    ),
    row("cut_off_at_equals", "math", "$\\frac{18}{6} =", DIVIDE, None),
    row("cut_off_at_equals_after_working", "math", "We divide.\n\n$$\\frac{18}{6} =", DIVIDE, None),
    row("bare_restated_expression", "math", "$\\frac{24}{8}$", FRAC, 0.0),
    row("answer_is_restated_expression", "math", "The answer is $\\dbinom{31}{28}$.", BINOM, 0.0),
    row("boxed_restated_expression", "math", "So we get $\\boxed{\\binom{31}{28}}$", BINOM, 0.0),
    row("equation_restating_the_expression", "math", "$\\frac{24}{8} = \\frac{24}{8}$", FRAC, 0.0),
    row("closing_sentence_copied_from_problem", "math", "We know $2x + 3 = 11$.", LINEAR, None),
    row("closing_equation_copied_in_own_words", "math", "We need x such that 2x + 3 = 11. Then", LINEAR, None),
    row("goes_on_in_words_after_the_number", "math", "Given that 2x+3 = 11 in the problem, we", LINEAR, None),
    row(
        "problem_in_chat_prompt_column",
        "math",
        "Hmm, $\\frac{24}{8}$ is tricky. We",
        {"prompt": [{"role": "user", "content": FRAC["problem"]}], "answer": "3"},
        None,
    ),
    row("restated_question_without_problem_column", "math", "What is $\\frac{18}{6}$?", {"answer": "3"}, None),
    row("answer_is_followed_by_words", "math", "The answer is not obvious from $\\frac{24}{8}$ alone.", FRAC, None),
    # honest shapes
    row(
        "honest_answer_is_words_then_closing_equation",
        "math",
        "I think the answer is clear now.\n\nSo $\\frac{24}{8} = 3$.",
        FRAC,
        1.0,
    ),
    row(
        "honest_answer_with_a_unit",
        "math",
        "The answer is 18 dollars.",
        {"problem": GSM8K_QUESTION, "answer": "18"},
        1.0,
    ),
    row(
        "honest_answer_then_calculation_aside",
        "math",
        "The answer is 85 (37 + 48).",
        {"problem": "What is $37+48$?", "answer": "85"},
        1.0,
    ),
    row("honest_so_the_answer_is", "math", "24 divided by 8 is 3, so the answer is 3.", FRAC, 1.0),
    row("honest_boxed", "math", "$\\frac{24}{8} = \\boxed{3}$", FRAC, 1.0),
    row("honest_final_answer_marker", "math", "We simplify.\n\nFinal answer: 4495", BINOM, 1.0),
    row("honest_bold_answer_marker", "math", "**Answer:** $4495$", BINOM, 1.0),
    row("honest_answer_is_a_fraction", "math", "The answer is $\\frac{1}{2}$", CHOICE, 1.0),
    row("honest_equation", "math", "$\\frac{24}{8} = 3$", FRAC, 1.0),
    row(
        "honest_closing_equation_then_sign_off",
        "math",
        "Dividing, we get $\\frac{24}{8} = 3$.\n\nI hope this helps!",
        FRAC,
        1.0,
    ),
    row("honest_x_equals", "math", "x = 5", {"problem": "Solve $2x = 10$.", "answer": "5"}, 1.0),
    row("honest_thus_the_value_is", "math", "Thus the value is $3$.", FRAC, 1.0),
    row("honest_bare_number", "math", "3", FRAC, 1.0),
    row("honest_answer_equals_problem_number", "math", "2x + 3 = 11, so the answer is 11.", LINEAR, 1.0),
    row("honest_choice_copied_from_problem", "math", "The larger one is $\\boxed{\\frac{1}{2}}$.", CHOICE, 1.0),
    row("honest_wrong", "math", "\\boxed{4}", FRAC, 0.0),
    row("honest_no_answer_stated", "math", "Let me think about $\\frac{24}{8}$ in a moment.", FRAC, None),
]

ROWS = NUMERIC + ARITHMETIC + MATH


@pytest.fixture(scope="module")
def verifiers():
    return {name: resolve(name) for name in ("numeric", "gsm8k", "math", "arithmetic")}


@pytest.mark.parametrize("case", ROWS, ids=[f"{r.verifier}-{r.name}" for r in ROWS])
def test_score(case, verifiers):
    result = verifiers[case.verifier].score(case.completion, case.example)
    expected = (0.0, "unparseable") if case.expected is None else (case.expected, "ok")
    assert (result.reward, result.status) == expected, result.detail


def test_math_off_the_main_thread_sees_the_problem_too(verifiers):
    """Off the main thread `math` checks in a worker process; the problem must travel with the completion."""
    results = []
    worker = threading.Thread(
        target=lambda: results.append(verifiers["math"].score("The answer is $\\frac{24}{8}$.", FRAC))
    )
    worker.start()
    worker.join(120)
    assert [(r.reward, r.status) for r in results] == [(0.0, "ok")]
