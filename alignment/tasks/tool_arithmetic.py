"""Products of a 3-digit and a 2-digit number ("What is 123*45?"), a task that needs a calculator: the offline
task of tool use (recipes/smollm2-135m/tools.yaml).

`demonstrations: true` gives two SFT rows per problem, each a conversational `prompt` and a one-turn `completion`,
so that SFT trains exactly one assistant turn of each (it trains every assistant turn of a `messages` row, which
would demonstrate the call in every problem's second row): the first turn, a calculator call ([user] ->
<tool_call>...) for a `call_fraction` share of the problems and a direct answer for the others; and the answer
after the calculator's result ([user, assistant: call, tool: <tool_response>...</tool_response>] -> answer), for
every problem, so that a policy which calls learns to use the result whatever share of problems demonstrates the
call. The calls are written in the
`hermes` tool format for a chat template without tool support (a recipe's `tool_format: hermes`), as
alignment/tools/formats.py renders them (tests/test_tools_stages.py holds the two equal). Otherwise rows hold
`prompt` and `answer`, and the verifier is arithmetic's (demonstrations keep `answer` too).
"""

from __future__ import annotations

import json
import random

from ..config.tasks import ToolArithmeticParams
from .arithmetic import _operand, verify
from .splits import band, band_of

__all__ = ["build", "verify"]


def call_text(expression: str) -> str:
    """A hermes calculator call, as `ToolFormat("hermes").call_text` writes it."""
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


def result_text(value: str) -> str:
    """A tool result's content, as a hermes tool turn wraps it for a template without tool support."""
    return f"<tool_response>\n{value}\n</tool_response>"


def build(params: ToolArithmeticParams, split: str, seed: int) -> list[dict]:
    wanted = band_of(split, "tool_arithmetic", params.validation_fraction)
    rng = random.Random(f"{seed}-{split}-tools")
    rows: list[dict] = []
    problems = 0
    for _ in range(params.n * 1000):
        if problems == params.n:
            break
        a, b = _operand(rng, params.digits[0]), _operand(rng, params.digits[1])
        if band(f"{a}*{b}", params.test_fraction, params.validation_fraction) != wanted:
            continue
        problems += 1
        rows += _rows(a, b, params, rng)
    return rows


def _rows(a: int, b: int, params: ToolArithmeticParams, rng: random.Random) -> list[dict]:
    expression, answer = f"{a}*{b}", str(a * b)
    question = (
        f"What is {a} * {b}? Answer with just the number." if params.phrasing == "chat" else f"What is {expression}?"
    )
    if not params.demonstrations:
        return [{"prompt": question, "answer": answer}]
    user = {"role": "user", "content": question}
    call = {"role": "assistant", "content": call_text(expression)}
    result = {"role": "tool", "name": "calculator", "content": result_text(answer)}
    first = call if rng.random() < params.call_fraction else {"role": "assistant", "content": answer}
    return [
        {"prompt": [user], "completion": [first], "answer": answer},
        {"prompt": [user, call, result], "completion": [{"role": "assistant", "content": answer}], "answer": answer},
    ]
