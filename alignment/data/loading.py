"""Dataset specs -> `datasets.Dataset`, with per-stage column checks.

A spec names exactly one source:
  - `dataset: HuggingFaceH4/ultrachat_200k` (hub id, with `config` and `split`),
  - `dataset: data/train.jsonl` (local .json/.jsonl/.parquet/.csv file, or a folder of them),
  - `task: arithmetic` (a built-in task; other keys are the task's parameters).
Then `rename`, `shuffle` (with the recipe seed) and `limit` apply, in that order. Errors name the
spec's place in the recipe, the file and the columns that exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import datasets

from ..config.base import did_you_mean
from ..config.data import DataSpec
from ..errors import UserError
from ..tasks import get_task

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def resolve_local(path: str, base_dir: Path | None) -> Path | None:
    """A local file or folder for `path` (as given, or relative to the recipe's folder), else None."""
    candidates = [Path(path).expanduser()]
    if base_dir is not None and not Path(path).is_absolute():
        candidates.append(base_dir / path)
    return next((c for c in candidates if c.exists()), None)


def looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix.lower() in LOCAL_FORMATS or name.count("/") > 1


def load_rows(spec: DataSpec, seed: int, base_dir: Path | None = None, where: str = "data"):
    """The dataset a spec describes, as a `datasets.Dataset`, renamed, shuffled and limited."""
    if spec.task is not None:
        rows = get_task(spec.task).build(spec.task_params(), spec.split, seed)
        dataset = datasets.Dataset.from_list(rows)
    else:
        dataset = _load_source(spec, base_dir, where)
    dataset = _rename(dataset, spec.rename, where)
    if spec.shuffle:
        dataset = dataset.shuffle(seed=seed)
    if spec.limit is not None:
        dataset = dataset.select(range(min(spec.limit, len(dataset))))
    if len(dataset) == 0:
        raise UserError(f"{where}: {spec.describe()} has no rows.")
    return dataset


def _load_source(spec: DataSpec, base_dir: Path | None, where: str):
    local = resolve_local(spec.dataset, base_dir)
    if local is not None:
        return _load_local(local, where)
    if looks_like_local_path(spec.dataset):
        raise UserError(f"{where}.dataset: file '{spec.dataset}' does not exist (looked in the current folder"
                        + (f" and in {base_dir}" if base_dir else "") + ").")
    try:
        return datasets.load_dataset(spec.dataset, spec.config, split=spec.split)
    except Exception as error:  # the hub raises many types: offline, missing, gated, bad split
        raise UserError(
            f"{where}.dataset: could not load '{spec.dataset}' (config {spec.config!r}, split '{spec.split}') from "
            f"the Hugging Face Hub or its local cache: {type(error).__name__}: {_first_line(error)}. Without network "
            "access only datasets already in the cache (or local files) can be used."
        ) from None


def _load_local(path: Path, where: str):
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in LOCAL_FORMATS) if path.is_dir() else [path]
    if not files:
        raise UserError(f"{where}.dataset: folder '{path}' holds no {'/'.join(LOCAL_FORMATS)} files.")
    if all(p.stat().st_size == 0 for p in files):
        raise UserError(f"{where}.dataset: '{path}' is empty (no rows).")
    kinds = {LOCAL_FORMATS.get(p.suffix.lower()) for p in files}
    if None in kinds or len(kinds) > 1:
        raise UserError(
            f"{where}.dataset: '{path}' is not a supported file type; use one of {', '.join(LOCAL_FORMATS)}."
        )
    try:
        return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
    except Exception as error:
        raise UserError(f"{where}.dataset: could not read '{path}': {type(error).__name__}: {_first_line(error)}") from None


def _rename(dataset, mapping: dict[str, str], where: str):
    for old, new in mapping.items():
        if old not in dataset.column_names:
            raise UserError(
                f"{where}.rename: column '{old}' does not exist{did_you_mean(old, dataset.column_names)}; "
                f"columns: {', '.join(dataset.column_names)}."
            )
        dataset = dataset.rename_column(old, new)
    return dataset


def check_columns(dataset, alternatives: Sequence[Sequence[str]], where: str, spec: DataSpec | None = None) -> tuple:
    """The first alternative whose columns all exist; otherwise a UserError naming what is missing."""
    columns = dataset.column_names
    for wanted in alternatives:
        if all(c in columns for c in wanted):
            return tuple(wanted)
    options = " or ".join("(" + ", ".join(w) + ")" for w in alternatives)
    best = max(alternatives, key=lambda w: sum(c in columns for c in w))
    missing = [c for c in best if c not in columns]
    source = f" of {spec.describe()}" if spec else ""
    hint = "".join(did_you_mean(m, columns) for m in missing[:1])
    raise UserError(
        f"{where}: missing column(s) {', '.join(repr(m) for m in missing)}{hint}{source}; this stage needs "
        f"{options}. Columns present: {', '.join(columns) or '(none)'}. Use 'rename: {{old: new}}' to map columns."
    )


def file_rows(dataset) -> list[int]:
    """For each row of a loaded dataset, its row in the data as written (the file's, 0-based): `shuffle` and
    `limit` keep that mapping (datasets' indices mapping), so an error can name the row a user can find."""
    mapping = getattr(dataset, "_indices", None)
    return mapping.column(0).to_pylist() if mapping is not None else list(range(len(dataset)))


def check_strings(dataset, columns: Sequence[str], where: str) -> None:
    """Every value in `columns` is a non-empty string (or a list of chat messages)."""
    rows = file_rows(dataset)
    for column in columns:
        for index, value in zip(rows, dataset[column]):
            if isinstance(value, list) and column in ("prompt", "messages", "completion"):
                continue
            if not isinstance(value, str):
                raise UserError(f"{where}: row {index}, column '{column}' is {type(value).__name__} {value!r}, "
                                "not a string.")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


