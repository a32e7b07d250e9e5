"""A task that a tiny model can solve only with a tool, for the tool-learning test (tests/test_tools_learning.py).

"What is in box qxv?" asks for a digit drawn at random per row: no policy can know it, and the `open_box()` tool
of the `SecretBox` environment shows it. The tool takes no arguments, so a call needs no copying from the prompt
(what the tiny model did not learn in minutes of CPU for the calculator, docs/results.md), and the answer repeats
the digit the tool shows. Boxes are named by letters, so no other digit is in sight, and the tool shows its digit
`SHOWN` times: a from-scratch model's attention starts out nearly uniform over the context, and a digit filling a
larger share of it is copied sooner (in the test's SFT mixture, shown once, seeds 1 and 2 of 0-2 had not learned
to copy it in 200 steps; shown 16 times, seed 1 had by step 150). The demonstrations (`sft_rows`) call the tool for a
`call_fraction` share of
the problems and guess a digit for the others (right one time in ten), and show the answer after the tool's result
for every problem.
"""

from __future__ import annotations

import random
import string

from alignment.tools.formats import Call, ToolFormat

TOOL = "open_box"
SHOWN = 16  # times the tool repeats its digit (module docstring: why)


class SecretBox:
    """One box per rollout: reset to its row, its digit shown by open_box()."""

    def reset(self, row):
        self.content = str(row["answer"])

    def open_box(self) -> str:
        """Open the box and see the digit inside."""
        return self.content * SHOWN


def rl_rows(n: int, seed: int, salt: str = "rl") -> list[dict]:
    """`n` prompts with distinct box names (an environment is reset through the prompt) and their digits."""
    rng = random.Random(f"secret-box-{salt}-{seed}")
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choices(string.ascii_lowercase, k=3)))
    return [{"prompt": f"What is in box {name}?", "answer": str(rng.randrange(10))} for name in sorted(names)]


def sft_rows(n: int, seed: int, call_fraction: float, style: str = "hermes") -> list[dict]:
    """Prompt/completion rows (only the completion is trained): per problem its first turn (the call for a
    `call_fraction` share, else a guessed digit), and its answer after the tool's result."""
    rng = random.Random(f"secret-box-sft-{seed}")
    fmt = ToolFormat(style, native=False)
    call = {"role": "assistant", "content": fmt.call_text([Call(TOOL, {})])}
    rows = []
    for row in rl_rows(n, seed, salt="sft"):
        user = {"role": "user", "content": row["prompt"]}
        shown = row["answer"] * SHOWN
        shown = f"<tool_response>\n{shown}\n</tool_response>" if style == "hermes" else shown
        result = {"role": "tool", "name": TOOL, "content": shown}
        first = call if rng.random() < call_fraction else {"role": "assistant", "content": str(rng.randrange(10))}
        rows += [
            {"prompt": [user], "completion": [first]},
            {"prompt": [user, call, result], "completion": [{"role": "assistant", "content": row["answer"]}]},
        ]
    return rows
