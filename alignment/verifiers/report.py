"""Score a file of completions with a verifier: the engine of ``align verify``.

    from alignment.verifiers.report import verify_file
    report = verify_file("gsm8k", Path("samples.jsonl"))             # column "completion"
    report["pass_rate"], report["examples"]["failed"]

The file is JSON Lines (``.jsonl``; ``.json`` holding a list of objects or JSON Lines also works)
or CSV with a header (values are strings). Each row's `column` is the completion; every other
column is passed to the verifier as a keyword (e.g. ``answer``, ``tests``). `where` ({column: value})
scores only the matching rows (e.g. the ``mode=main`` rows of evaluation's samples.jsonl). The result:
the pass rates plus example rows per outcome (`verify_file`).

A missing file, an unsupported extension, an unreadable row, a missing column or a `where` no row
matches raises UserError naming the file (and row, or the columns or values that do exist).
"""

from __future__ import annotations

import csv
import difflib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from alignment.errors import UserError
from alignment.verifiers.base import VerifyResult, is_pass, summarize
from alignment.verifiers.registry import resolve

SUFFIXES = (".jsonl", ".json", ".csv")
EXAMPLES_PER_KIND = 3
_PREVIEW_CHARS = 300


def _load_json(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc}).") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{path}, line {number}: not valid JSON ({exc.msg}); each line must be one JSON object."
            ) from None
    return rows


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL/JSON/CSV file as dicts; UserError for anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"File not found: {path}. Give the path of a .jsonl or .csv file of completions.")
    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"{path}: unsupported file type '{path.suffix}'. Use one of {', '.join(SUFFIXES)}.")
    try:
        if path.suffix.lower() == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                rows: list[Any] = list(csv.DictReader(f))
        else:
            rows = _load_json(path)
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc}).") from None
    if not isinstance(rows, list):
        raise UserError(f"{path}: expected a list of objects, got {type(rows).__name__}.")
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise UserError(f"{path}, row {number}: expected a JSON object, got {type(row).__name__}.")
    if not rows:
        raise UserError(f"{path}: the file has no rows.")
    return rows


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _select(path: Path, rows: list[dict], where: Mapping[str, str]) -> list[tuple[int, dict]]:
    """(1-based file row number, row) of the rows matching every `where` column=value."""
    selected = [
        (number, row)
        for number, row in enumerate(rows, start=1)
        if all(column in row and _as_text(row[column]) == str(value) for column, value in where.items())
    ]
    if not selected:
        held = {column: sorted({_as_text(r[column]) for r in rows if column in r})[:10] for column in where}
        found = "; ".join(f"'{c}' holds {', '.join(v)}" if v else f"no row has a column '{c}'" for c, v in held.items())
        wanted = ", ".join(f"{c}={v}" for c, v in where.items())
        raise UserError(f"{path}: no row has {wanted}; {found}.")
    return selected


def _check_columns(path: Path, rows: list[dict], needed: Iterable[str], numbers: list[int] | None = None) -> None:
    present = set().union(*(row.keys() for row in rows))
    numbers = numbers or list(range(1, len(rows) + 1))
    for column in needed:
        missing = [number for number, row in zip(numbers, rows) if column not in row]
        if missing:
            close = difflib.get_close_matches(column, sorted(present), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            where = "any row" if len(missing) == len(rows) else f"row {missing[0]} (and {len(missing) - 1} more)"
            raise UserError(
                f"{path}: column '{column}' is missing from {where}.{hint} Columns in the file: "
                f"{', '.join(sorted(present))}."
            )


def _example(number: int, completion: Any, result: VerifyResult) -> dict[str, Any]:
    text = completion if isinstance(completion, str) else json.dumps(completion, default=str)
    preview = text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "..."
    return {"row": number, "reward": result.reward, "detail": result.detail, "completion": preview}


def verify_file(
    name: str,
    path: Path,
    column: str = "completion",
    search_dirs: Iterable[str | Path] | None = None,
    options: Mapping[str, Any] | None = None,
    where: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Score every row of `path` (those matching `where`) with verifier `name`; summary plus example rows
    per outcome.

    The result is the `summarize` dict (n, pass_rate, mean_reward, unparseable_rate, error_rate) plus the
    verifier, file and column names and up to 3 example rows each of passed / failed / unparseable / error,
    each with its 1-based row number (as in the file, `where` or not), reward, detail and the start of the
    completion. `where` values are compared as text (a JSON value as JSON writes it: ``3``, ``true``)."""
    verifier = resolve(name, options=options, search_dirs=search_dirs)
    path = Path(path)
    numbers, rows = zip(*_select(path, load_rows(path), where or {}))
    _check_columns(path, list(rows), [column, *verifier.required_columns], list(numbers))
    completions = [row[column] for row in rows]
    examples = [{k: v for k, v in row.items() if k != column} for row in rows]
    results = verifier.score_batch(completions, examples)
    buckets: dict[str, list[dict[str, Any]]] = {"passed": [], "failed": [], "unparseable": [], "error": []}
    for number, completion, result in zip(numbers, completions, results, strict=True):
        kind = "passed" if is_pass(result) else "failed" if result.status == "ok" else result.status
        if len(buckets[kind]) < EXAMPLES_PER_KIND:
            buckets[kind].append(_example(number, completion, result))
    return {
        "verifier": verifier.name,
        "file": str(path),
        "column": column,
        "where": dict(where or {}),
        **summarize(results),
        "examples": buckets,
    }
