"""The built-in tools: `calculator` (exact arithmetic, parsed with `ast`, never `eval`) and `python` (the code
sandbox of alignment/verifiers/sandbox/ as an interpreter).

    calculator("(123 * 45) / 7")  -> "5535/7"
    make_python(timeout=5)("print(2 ** 10)")  -> "1024\n"

A tool is a plain function with type hints and a Google-style docstring: the model sees its name, its
arguments and the docstring's description (transformers' `get_json_schema`). It returns text; it may raise,
and the rollout shows the error to the model as the tool's result and counts it.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from ..verifiers.sandbox.process import Limits, run_python

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 400  # largest operand or result, in decimal digits: 10**1000000 must not be computed
MAX_EXPONENT = 256
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def _digits(value: Fraction) -> int:
    return max(len(str(abs(value.numerator))), len(str(value.denominator)))


def _bounded(value: Fraction) -> Fraction:
    if _digits(value) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError("only whole-number exponents are supported (the result would not be exact)")
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponents are limited to +-{MAX_EXPONENT}")
    # Bound the size before computing: digits(base ** e) is about e * digits(base).
    if _digits(base) * abs(int(exponent)) > MAX_DIGITS * 2:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("division by zero")
    return base ** int(exponent)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # Decimal literals are read exactly as written (0.1 is 1/10, not the nearest binary float).
        return _bounded(Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _bounded(OPERATORS[type(node.op)](left, right))
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: only numbers, + - * / ** and parentheses")


def format_number(value: Fraction) -> str:
    """An integer as an integer, a fraction with a short exact decimal as that decimal, else p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    places = max(twos, fives)
    if denominator == 1 and places <= 20:
        scaled = abs(value.numerator) * 10**places // value.denominator
        sign = "-" if value < 0 else ""
        whole, fraction = divmod(scaled, 10**places)
        return f"{sign}{whole}.{fraction:0{places}d}".rstrip("0")
    return f"{value.numerator}/{value.denominator}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / ** and parentheses, e.g. "(123 * 45) / 7"
    """
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    return format_number(_evaluate(tree))


def make_python(timeout: float = 5.0, memory_mb: int = 512, output_chars: int = 2000, allow_unsandboxed: bool = False):
    """The `python` tool with its limits bound (the recipe's `options:`). The code runs in the verifier
    sandbox (docs/sandbox.md says what that isolates and what not): its own process in new network, pid and
    mount namespaces on a minimal root (no host sockets, no run data), resource limits, `memory_mb` for all
    its processes together where a cgroup can be made, no environment of ours, killed at `timeout`. A run
    past its time or memory is an error (counted by the rollout); the model still sees the output."""
    limits = Limits(timeout=timeout, memory_mb=memory_mb, output_bytes=max(4 * output_chars, 1024))

    def python(code: str) -> str:
        """Run Python code and return what it prints (stdout and stderr).

        Args:
            code: a Python program; print the values you want to see
        """
        result = run_python(code, "", limits, allow_unsandboxed=allow_unsandboxed)
        output = result.output
        if len(output) > output_chars:
            output = output[: output_chars // 2] + "\n[... output cut ...]\n" + output[-output_chars // 2 :]
        if result.status == "timeout":  # an error, so the rollout counts it; the model still sees the output
            raise TimeoutError(f"the code ran past {timeout:g} s and was killed; its output: {output}")
        if result.status == "memory":
            raise MemoryError(f"the code used more than its {memory_mb} MB and was killed; its output: {output}")
        if result.status == "setup_error":
            raise RuntimeError(f"the sandbox failed to start: {output}")
        return output

    return python


# name -> factory taking the recipe's options and returning the tool function.
BUILTINS = {"calculator": lambda: calculator, "python": make_python}
