"""The package's docstrings and comments are a manual, not a lab notebook (docs/architecture.md, house rule 6), and
docs/architecture.md names every module.

- A module docstring says what the module does, its contract and its limits, in at most 15 lines.
- No docstring or comment under alignment/ quotes a measured figure (a number with a unit of time, speed,
  memory or ratio) or an issue number: figures live in docs/performance.md and docs/results.md beside the
  command that measured them, and the code links there. Constants and defaults that happen to carry such a
  unit are allowed one by one in ALLOWED, each with its reason.
- docs/architecture.md's "## Modules" section names every module of alignment/ and nothing that is not one.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "alignment"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_MODULE_DOCSTRING_LINES = 15

# A measured figure: a number (a range such as 1.3-1.8x ends in one) followed by a unit of time, speed, memory
# or ratio. `x`/`×` count only when glued to the number ("2.5x"), so "48 x 1024" (arithmetic) is not a figure.
UNITS = (
    r"(?:\s?(?:tokens?/s|tok/s|it/s|steps?/s|samples?/s|rows?/s|pairs?/s|episodes?/s|[KMGT]i?B/s|[GT]FLOP/s"
    r"|[KMGT]iB|[KMGT]B|ms|µs|us|ns|s|sec|seconds?|min|minutes?|h|hours?|points?|pp|%)|[x×])"
)
FIGURE = re.compile(r"(?<![\w.])[+\-−~]?\d+(?:[.,]\d+)*" + UNITS + r"(?![\w/])")
# An issue number: "#28", "issue 28", "issues #28 and". A full URL to an upstream tracker is a reference and
# passes; a '#2' inside quotes is a literal (a name suffix), not an issue.
ISSUE = re.compile(r"(?<![\w/'\"`])#\d+\b|\bissues?\s+#?\d+\b", re.IGNORECASE)
# Text a docstring quotes as an example of input ("25%" parsed as 25, ``2x+3=11``) is not a claim.
QUOTED = re.compile(r"``.*?``|`[^`\n]*`|\"[^\"\n]*\"", re.DOTALL)

# (file under alignment/, the matched text): why it is not a measured figure. Keep it short.
ALLOWED = {
    ("rl.py", "20%"): "the adaptive KL controller's clip (Ziegler et al. 2019), a constant of the method",
}


def module_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def docstrings(tree: ast.Module):
    """(line, text) of every module, class and function docstring."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield node.body[0].lineno, text


def comments(source: str):
    """(line, text) of every comment."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def offences(relative: str, text: str) -> list[str]:
    """The measured figures and issue numbers in one docstring or comment, less the allowed ones."""
    found = [m.group().strip() for m in ISSUE.finditer(text)]
    found += [m.group().strip() for m in FIGURE.finditer(QUOTED.sub(" ", text))]
    return [f for f in found if (relative, f.lstrip("+-−~")) not in ALLOWED]


def test_module_docstrings_are_at_most_15_lines():
    long = []
    for path in module_files():
        text = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        lines = len(text.strip().splitlines())
        if lines > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{path.relative_to(REPO)} ({lines} lines)")
    assert not long, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (say what, the contract and the "
        f"limits; move detail to the function it is about or to docs/): " + ", ".join(long)
    )


def test_no_measured_figures_or_issue_numbers_in_docstrings_or_comments():
    bad = []
    for path in module_files():
        relative, source = path.relative_to(PACKAGE).as_posix(), path.read_text()
        for line, text in [*docstrings(ast.parse(source)), *comments(source)]:
            bad += [f"alignment/{relative}:{line}: {found!r}" for found in offences(relative, text)]
    assert not bad, (
        "measured figures or issue numbers in docstrings/comments (figures go to docs/performance.md "
        "or docs/results.md, linked from the code; issue numbers go nowhere):\n" + "\n".join(bad)
    )


def test_the_figure_and_issue_patterns():
    flagged = [
        "decodes 1.3-1.8x the tokens/s",
        "1300 tokens/s",
        "took 93 ms a call",
        "270 MB in bf16",
        "20 s after",
        "5.9 s for",
        "+9 points of accuracy",
        "gained +12 points",
        "15% of a step",
        "561 against 902 GFLOP/s",
        "29 GB/s read",
        "peak 955 MiB",
        "issue #28",
        "(#30)",
        "see issue 31",
        "3 min 24 s",
    ]
    passed = [
        "48 x 1024",
        "4 x hidden bytes",
        "float32",
        "top_k=50",
        "0.05",
        "pytorch/pytorch/issues/151934",
        "a '#2' suffix",
        'trailing "25%" is ignored',
        "``2x+3``",
        "bf16",
        "fp32",
        "step 64",
        "Qwen2.5",
    ]
    assert all(offences("x.py", text) for text in flagged), [t for t in flagged if not offences("x.py", t)]
    assert not any(offences("x.py", text) for text in passed), [t for t in passed if offences("x.py", t)]
    assert offences("rl.py", "by at most 20% per `horizon` steps") == []  # allowed there only
    assert offences("stages/ppo.py", "by at most 20% per `horizon` steps") == ["20%"]


# docs/architecture.md: every module named, every name a module.


def modules_section() -> str:
    text = ARCHITECTURE.read_text()
    start = text.index("\n## Modules\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_architecture_names_every_module_and_only_modules():
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", modules_section(), re.MULTILINE))  # a row's first cell
    tree = {path.relative_to(PACKAGE).as_posix() for path in module_files()}
    missing, stale = sorted(tree - named), sorted(named - tree)
    assert not missing, (
        "modules named nowhere in docs/architecture.md's '## Modules' section (add a row "
        "`path.py` | what it holds, under its layer): " + ", ".join(f"alignment/{m}" for m in missing)
    )
    assert not stale, "docs/architecture.md's '## Modules' section names modules that do not exist: " + ", ".join(
        f"alignment/{m}" for m in stale
    )
