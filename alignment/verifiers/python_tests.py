"""`python_tests` verifier: run the completion's code against the row's unit tests in the sandbox.

The `tests` column holds assert statements or unittest.TestCase classes (a string, or a list of strings
joined by newlines, as MBPP's ``test_list``: ``rename: {test_list: tests}``); they run after the code, in
its namespace. The code is what a reader would run: the completion's python blocks joined in order, less
console output and example usage (rules in `extract_code`); without a fenced block, the whole completion.
``if __name__ == "__main__":`` never runs. The tests' comparisons go through `safe_compare`, so objects
that claim equality do not pass; what the sandbox does and does not contain: docs/sandbox.md.

Rewards: 1.0 if the tests pass; 0.0 if they fail, time out, crash or do not compile; None without code; a
bad `tests` column is a data error. Options: ``timeout`` (s, default 5), ``memory_mb`` (1024),
``max_processes`` (32), ``allow_unsandboxed`` (false: resolving raises UserError without isolation).

    v = resolve("python_tests", options={"timeout": 2})
    v.score("```python\\ndef add(a, b):\\n    return a + b\\n```", {"tests": "assert add(1, 2) == 3"})
"""

from __future__ import annotations

import ast
import re
from numbers import Real
from typing import Any

from alignment.errors import UserError
from alignment.verifiers.base import VerifyResult
from alignment.verifiers.sandbox import process, safe_compare

# a fence with its info string ("```python", "``` py", "```bash"), then the block up to the closing
# fence or the end of the text; matching every language keeps a bash block's closing fence from
# opening a block of its own
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "python3", "py")
_PROMPT = re.compile(r"^\s*(>>>|\.\.\.)(?: |$)")


def _blocks(completion: str) -> list[tuple[str, bool]] | None:
    """(code, tagged) of the python blocks, in order; None when the completion has no fence."""
    found = _FENCE.findall(completion)
    if not found:
        return None
    tagged = [(code, True) for lang, code in found if lang.lower() in _PYTHON_TAGS]
    return tagged or [(code, False) for lang, code in found if not lang]


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # deep nesting, NUL bytes
        return None


def _transcript_code(block: str) -> str:
    """The code of a console transcript: its examples without prompts; output lines dropped."""
    lines, in_example = [], False
    for line in block.splitlines():
        prompt = _PROMPT.match(line)
        if prompt and (prompt.group(1) == ">>>" or in_example):
            lines.append(line[prompt.end() :])
            in_example = True
        elif in_example and line.strip():
            continue  # expected output of the example above
        else:
            in_example = False
            lines.append(line)
    return "\n".join(lines) + "\n"


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _names(nodes, ctx: type) -> set[str]:
    """Names loaded (ctx=ast.Load) or bound (ast.Store) by `nodes`."""
    return {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _module_level(tree: ast.Module):
    """The nodes that run in the module's own scope: not those inside a function or lambda."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _defined(tree: ast.Module) -> set[str]:
    """Global names a block binds: functions, classes, imports and module-level assignments."""
    names = _names(_module_level(tree), ast.Store)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _reads(tree: ast.Module | None) -> set[str]:
    """Global names a block may read: loads at module level, and loads inside functions of names
    the function does not bind itself (a function's own `result` is not the module's)."""
    if tree is None:
        return set()
    reads = _names(_module_level(tree), ast.Load)
    for scope in (n for n in ast.walk(tree) if isinstance(n, _SCOPES)):
        local = {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)} | _names(ast.walk(scope), ast.Store)
        declared = {name for g in ast.walk(scope) if isinstance(g, ast.Global) for name in g.names}
        reads |= _names(ast.walk(scope), ast.Load) - (local - declared)
    return reads


def _is_example_usage(tree: ast.Module, defined: set[str], read: set[str]) -> bool:
    """Whether a block only exercises earlier blocks (rules in `extract_code`)."""
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)
    if any(isinstance(node, definitions) for node in tree.body):
        return False
    if _names(_module_level(tree), ast.Store) & read:
        return False  # it sets something the earlier code or the tests read: part of the program
    return bool(_names(ast.walk(tree), ast.Load) & defined)


def _program(blocks: list[tuple[str, bool]], tests: str) -> str:
    """The blocks a reader would run, joined in order."""
    parsed = []
    for code, tagged in blocks:
        tree = _parse(code)
        if tree is None and ">>>" in code:
            code = _transcript_code(code)
            tree = _parse(code)
        parsed.append((code, tree, tagged))
    if any(tree is not None for _, tree, tagged in parsed if not tagged):
        # untagged blocks are a guess at code: one that does not compile is output or a shell line
        parsed = [(code, tree, tagged) for code, tree, tagged in parsed if tagged or tree is not None]
    kept, defined, read = [], set(), _reads(_parse(tests))
    for code, tree, _ in parsed:
        if tree is not None and kept and _is_example_usage(tree, defined, read):
            continue
        kept.append(code)
        if tree is not None:
            defined |= _defined(tree)
            read |= _reads(tree)
    return "\n".join(kept)


def extract_code(completion: str, tests: str = "") -> tuple[str | None, bool]:
    """(code, fenced): the program of the completion's python blocks, else the whole text (None if blank).

    Which code runs: what a reader would run. Models answer in prose with several fenced blocks (SmolLM2
    writes the function, then an "Example usage" block; running only the last block scored a correct
    solution 0 by a NameError). So the program is the completion's python blocks (```python, ```py,
    ```python3; untagged ``` blocks only when no block is tagged; other languages never; an unclosed last
    block runs to the end) joined in order, as a reader pastes them into one file, except:

    - a console transcript: a block that is not valid Python because it holds ``>>> `` lines runs as
      the code of its examples (the ``>>> ``/``... `` lines without their prompts); the lines that
      follow an example up to a blank line are its expected output, not code, and are dropped. Doctests
      inside a docstring are left alone (the block compiles);
    - example usage: a later block that defines no function, class or import, and assigns nothing that
      the code before it or the tests read, but uses what earlier blocks define (``print(add(1, 2))``,
      ``result = add(1, 2)``, its own asserts, a ``while True:`` demo loop) is not run. The tests
      decide; an example that raises, loops or asserts something wrong says nothing about the
      solution. Usage inside a block that also defines the solution runs as written: it is part of
      that program;
    - an untagged block that does not compile (program output, a shell command) is not code, unless
      no untagged block compiles (then they run and the syntax error is the verdict).

    Telling blocks apart parses them with `ast` here, which never runs them (time in proportion to the
    completion's length, bounded by the sampler's max_new_tokens); a block `ast` cannot parse is kept as
    is. `tests` is the tests' source: names it reads are never example usage."""
    blocks = _blocks(completion)
    if blocks is None:
        return (completion if completion.strip() else None), False
    code = _program(blocks, tests)
    return (code if code.strip() else None), True


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
    code, fenced = extract_code(completion, source)
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
