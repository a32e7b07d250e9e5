"""Verifiers: programmatic rewards shared by RLVR (reward), RSFT (filter) and evaluation (metric).

A verifier is a plain function ``def verify(completion: str, **example) -> float | None``: every
dataset column arrives as a keyword; it returns a reward (1.0 right, 0.0 wrong) or ``None`` when the
completion cannot be parsed, which scores 0 but is counted apart from "wrong". Recipes name one by a
built-in key (see `BUILTINS`), an installed plugin's entry point (group ``alignment.verifiers``) or
``package.module:function``.

    from alignment.verifiers import resolve, summarize
    v = resolve("numeric", options={"mode": "strict"})
    result = v.score("... #### 42", {"answer": "42"})      # VerifyResult(reward=1.0, status='ok', ...)
    print(summarize(v.score_batch(completions, rows)))     # pass_rate, mean_reward, unparseable_rate, ...

Built-ins: numeric/gsm8k, math, regex, think_format, answer_tag, json, python_tests (unit tests in a
sandbox), arithmetic (the built-in task's). Importing this package is cheap: built-ins load when resolved.
"""

from alignment.verifiers.base import Verifier, VerifyResult, is_pass, summarize
from alignment.verifiers.registry import BUILTINS, ENTRY_POINT_GROUP, available, resolve

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "Verifier",
    "VerifyResult",
    "available",
    "is_pass",
    "resolve",
    "summarize",
]
