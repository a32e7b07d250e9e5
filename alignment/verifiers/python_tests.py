"""`python_tests` verifier: run the completion's code against the row's unit tests in the sandbox.

The code is the last ```python (or ```py, or untagged ```) fenced block of the completion, an
unclosed last block running to the end included; without any block, the whole completion. The
`tests` column holds assert statements or unittest.TestCase classes (a string, or a list of
strings joined by newlines, as in MBPP's ``test_list``); they run after the code, in its namespace.

Rewards: 1.0 if the tests pass; 0.0 if they fail, time out, crash or the fenced code does not
compile (the detail says which, with the tail of the output); None if there is no code (blank
completion, or no fenced block and the text is not valid Python). An empty or non-compiling
`tests` column is a data error (error row).

Options: ``timeout`` (s, default 5), ``memory_mb`` (1024), ``max_processes`` (32) and
``allow_unsandboxed`` (false). Resolving the verifier probes the sandbox once and raises UserError
if no isolation works here, unless allow_unsandboxed is true. See `sandbox` for exactly what is and
is not contained.

The tests judge the solution's values, not objects that claim to be equal: their comparisons,
conditions and unittest asserts go through `safe_compare` (builtin data compared by value, ``3 ==
3.0``; a subclass by the builtin data it holds; an object with its own ``__eq__`` never equals a
builtin value). Reward hacks from inside the process (patching what the tests call, exiting early,
reading the harness's frames) are closed as listed in `sandbox`.

    v = resolve("python_tests", options={"timeout": 2})
    v.score("```python\\ndef add(a, b):\\n    return a + b\\n```", {"tests": "assert add(1, 2) == 3"})
"""

from __future__ import annotations

import re
from numbers import Real
from typing import Any

from alignment.errors import UserError
from alignment.verifiers.base import VerifyResult
from alignment.verifiers.sandbox import process, safe_compare

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> tuple[str | None, bool]:
    """(code, fenced): the last python block (tagged ones first), else the whole text."""
    blocks = _FENCE.findall(completion)
    tagged = [code for lang, code in blocks if lang]
    chosen = tagged or [code for _, code in blocks]
    if chosen:
        return (chosen[-1] if chosen[-1].strip() else None), True
    return (completion if completion.strip() else None), False


def _tests_source(tests: Any) -> str:
    source = "\n".join(map(str, tests)) if isinstance(tests, (list, tuple)) else str(tests or "")
    if not source.strip():
        raise ValueError("the tests column is empty: nothing to check the code against")
    try:
        safe_compare.compile_tests(source)  # our data, not the model's: compiling it here is safe
    except SyntaxError as exc:
        raise ValueError(f"the tests column is not valid Python: {exc}") from None
    return source


def verify(
    completion: str,
    tests: Any,
    *,
    timeout: float = 5.0,
    memory_mb: int = 1024,
    max_processes: int = 32,
    allow_unsandboxed: bool = False,
) -> VerifyResult | None:
    """1.0 if the code passes the tests in the sandbox, 0.0 if not, None if there is no code."""
    source = _tests_source(tests)
    code, fenced = extract_code(completion)
    if code is None:
        return None
    limits = process.Limits(timeout=float(timeout), memory_mb=int(memory_mb), max_processes=int(max_processes))
    result = process.run_python(code, source, limits, allow_unsandboxed=allow_unsandboxed)
    if result.passed:
        return VerifyResult(1.0, "ok", None)
    tail = result.output.strip()[-1500:]
    if result.status == "syntax_error" and not fenced:
        return VerifyResult(0.0, "unparseable", "no Python code found (no fenced block, and the text does not compile)")
    if result.status == "setup_error":
        return VerifyResult(0.0, "error", f"sandbox setup failed: {tail}")
    if result.status == "timeout":
        return VerifyResult(0.0, "ok", f"timeout after {timeout:g} s\n{tail}")
    if result.returncode == 0:  # exit(0) without the harness's nonce: it left before the tests ended
        return VerifyResult(0.0, "ok", f"exited with code 0 before the tests completed\n{tail}")
    return VerifyResult(0.0, "ok", f"{result.status} (exit code {result.returncode})\n{tail}")


def check_options(options: dict) -> None:
    """Called by resolve(): validate limits, then make sure a sandbox is available."""
    for key, minimum in (("timeout", 0.1), ("memory_mb", 64), ("max_processes", 1)):
        value = options.get(key, minimum)
        if isinstance(value, bool) or not isinstance(value, Real) or value < minimum:
            raise UserError(f"Verifier 'python_tests': option {key}={value!r} must be a number >= {minimum}.")
    if not isinstance(options.get("allow_unsandboxed", False), bool):
        raise UserError("Verifier 'python_tests': option allow_unsandboxed must be true or false.")
    process.require_isolation(options.get("allow_unsandboxed", False))


verify.check_options = check_options  # type: ignore[attr-defined]
verify.parallel = True  # type: ignore[attr-defined]  # each row waits on a subprocess: use threads
