"""Dataset specs -> `datasets.Dataset`, with per-stage column checks.

A spec names exactly one source:
  - `dataset: HuggingFaceH4/ultrachat_200k` (hub id, with `config` and `split`),
  - `dataset: data/train.jsonl` (local .json/.jsonl/.parquet/.csv file, or a folder of them; in a folder
    `split` picks the files named after it, `train_sft.jsonl` or `train_sft-00000-of-00001.parquet`, else
    the files `datasets` itself would give that split; `config` applies to hub datasets only),
  - `task: arithmetic` (a built-in task; other keys are the task's parameters).
Then `rename`, `shuffle` (with the recipe seed) and `limit` apply, in that order. Errors name the
spec's place in the recipe, the file and the columns that exist. Local text files are read through once
before `datasets` loads them (`scan_file`), so broken bytes, a broken JSON line or a ragged CSV row is
named by its line, and later errors name a row by its file and line (`file_rows`).
"""

from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
import pyarrow
import pyarrow.parquet
from datasets.data_files import DataFilesDict, get_data_patterns

from ..config.base import did_you_mean
from ..config.data import DataSpec
from ..errors import UserError, row_name
from ..tasks import get_task

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")  # train_sft-00000-of-00001.parquet, the hub's shard names
# Chat roles the major families' templates render (ipython: Llama 3.1's tool output; developer: OpenAI's
# system role). ChatML-style templates render any role verbatim, so a typo ("bot") would train silently.
CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython", "developer")


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
    origins = None
    if spec.task is not None:
        rows = get_task(spec.task).build(spec.task_params(), spec.split, seed)
        dataset = datasets.Dataset.from_list(rows)
    else:
        dataset, origins = _load_source(spec, base_dir, where)
    dataset = _rename(dataset, spec.rename, where)
    if spec.shuffle:
        dataset = dataset.shuffle(seed=seed)
    if spec.limit is not None:
        dataset = dataset.select(range(min(spec.limit, len(dataset))))
    if len(dataset) == 0:
        raise UserError(f"{where}: {spec.describe()} has no rows.")
    dataset.row_origins = origins  # read by file_rows; kept on this object only (a map() would drop it)
    return dataset


def _load_source(spec: DataSpec, base_dir: Path | None, where: str):
    """(dataset, each row's 'line L of FILE' or None where lines are not known)."""
    local = resolve_local(spec.dataset, base_dir)
    if local is not None:
        return _load_local(local, spec, where)
    if looks_like_local_path(spec.dataset):
        raise UserError(
            f"{where}.dataset: file '{spec.dataset}' does not exist (looked in the current folder"
            + (f" and in {base_dir}" if base_dir else "")
            + ")."
        )
    try:
        return datasets.load_dataset(spec.dataset, spec.config, split=spec.split), None
    except Exception as error:  # the hub raises many types: offline, missing, gated, bad split
        raise UserError(
            f"{where}.dataset: could not load '{spec.dataset}' (config {spec.config!r}, split '{spec.split}') from "
            f"the Hugging Face Hub or its local cache: {type(error).__name__}: {_first_line(error)}. Without network "
            "access only datasets already in the cache (or local files) can be used."
        ) from None


def _load_local(path: Path, spec: DataSpec, where: str):
    if spec.config is not None:
        raise UserError(
            f"{where}.config: '{spec.config}' cannot apply to the local {_kind_word(path)} '{path}': a "
            "config names a subset of a hub dataset. Remove `config:`, or point `dataset:` at the "
            "subset's own file or folder."
        )
    files = _split_files(path, spec.split, where) if path.is_dir() else _single_file(path, spec.split, where)
    kinds = {LOCAL_FORMATS.get(p.suffix.lower()) for p in files}
    if None in kinds or len(kinds) > 1:
        raise UserError(
            f"{where}.dataset: '{path}' is not a supported file type; use one of {', '.join(LOCAL_FORMATS)}."
        )
    if all(p.stat().st_size == 0 for p in files):
        raise UserError(f"{where}.dataset: {_names(files)} {'is' if len(files) == 1 else 'are'} empty (no rows).")
    origins = [origin for p in files for origin in scan_file(p, where)]
    try:
        with _quiet_datasets():
            dataset = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
    except Exception as error:
        if "corresponds to no data" in str(error):  # a CSV header alone, or only blank lines
            raise UserError(f"{where}.dataset: {_names(files)} holds no rows.") from None
        cause = error.__cause__ or error  # datasets wraps the reader's error in DatasetGenerationError
        raise UserError(
            f"{where}.dataset: could not read {_names(files)}: {type(cause).__name__}: {_first_line(cause)}"
        ) from None
    return dataset, (origins if len(origins) == len(dataset) else None)


def _kind_word(path: Path) -> str:
    return "folder" if path.is_dir() else "file"


def _names(files: list[Path]) -> str:
    return ", ".join(f"'{p}'" for p in files)


def split_of(path: Path) -> str:
    """The split a file holds by its name: its stem without a shard suffix (train_sft-00000-of-00001)."""
    return SHARD_SUFFIX.sub("", path.stem)


def _single_file(path: Path, split: str, where: str) -> list[Path]:
    """A file holds one split, which `datasets` calls 'train'; a file named after the split is that split too.
    Any other split would load the file under a name it does not hold (and the model card would say so)."""
    if split not in ("train", split_of(path)):
        raise UserError(
            f"{where}.split: '{split}' cannot apply to the single file '{path}', which holds one split. "
            "Remove `split:`, or point `dataset:` at a folder with one file per split named after it "
            f"({split}.jsonl or {split}-00000-of-00001.parquet)."
        )
    return [path]


def _split_files(folder: Path, split: str, where: str) -> list[Path]:
    """The folder's files of `split`: those named after it, else those `datasets` assigns it by its own
    naming rules (train_sft.jsonl is 'train' to it; a folder of unrelated names is all 'train')."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in LOCAL_FORMATS)
    if not files:
        raise UserError(f"{where}.dataset: folder '{folder}' holds no {'/'.join(LOCAL_FORMATS)} files.")
    named = [p for p in files if split_of(p) == split]
    if named:
        return named
    inferred = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    chosen = {Path(f).resolve() for f in inferred.get(split, [])}
    matched = [p for p in files if p.resolve() in chosen]
    if not matched:
        splits = sorted({split_of(p) for p in files} | set(inferred))
        raise UserError(
            f"{where}.split: folder '{folder}' holds no split '{split}'{did_you_mean(split, splits)}; "
            f"its files give the splits {', '.join(splits)}."
        )
    return matched


@contextmanager
def _quiet_datasets():
    """datasets logs a reader's error before raising it; we raise it as one UserError paragraph instead."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------
# Reading local files through once, so an error names the line


def scan_file(path: Path, where: str) -> list[str]:
    """Check a local file before `datasets` reads it and return each row's origin ('line L of FILE').

    `datasets` reports broken bytes or a broken JSON line without its line (or, for a CSV row with more
    fields than the header in first place, not at all: pandas makes the extra field an index column). The
    returned origins let later errors name the row as written. Parquet files are only opened (a truncated
    file has no footer); their rows have no lines."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            pyarrow.parquet.ParquetFile(path)
        except (pyarrow.ArrowException, OSError) as error:
            raise UserError(
                f"{where}.dataset: '{path}' is not a readable parquet file (truncated or corrupted?): "
                f"{_first_line(error)}"
            ) from None
        return []
    lines = _text_lines(path, where)
    if suffix == ".csv":
        return _csv_origins(path, lines, where)
    if suffix == ".jsonl":
        return _jsonl_origins(path, lines, where)
    for _ in lines:  # a .json file may be one document over many lines: only its bytes are checked
        pass
    return []


def _text_lines(path: Path, where: str) -> Iterator[str]:
    """The file's lines as text; bytes that are not UTF-8 are an error naming the line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(
                    f"{where}.dataset: '{path}', line {number}: byte {raw[error.start]:#04x} at column "
                    f"{error.start + 1} is not UTF-8 text ({error.reason}); save the file as UTF-8."
                ) from None


def _jsonl_origins(path: Path, lines: Iterator[str], where: str) -> list[str]:
    """One origin per non-blank line (the JSON reader skips blank ones); each must be a JSON object."""
    origins = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(
                f"{where}.dataset: '{path}', line {number}: not valid JSON ({error.msg} at column "
                f"{error.colno}); each line of a .jsonl file is one JSON object."
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"{where}.dataset: '{path}', line {number}: a JSON {type(row).__name__}, not an object "
                '({"column": value, ...}); each line of a .jsonl file is one row.'
            )
        origins.append(f"line {number} of {path}")
    return origins


def _csv_origins(path: Path, lines: Iterator[str], where: str) -> list[str]:
    """One origin per non-blank record (the line it starts on: a quoted field may span lines); a record
    with more fields than the header is an error."""
    reader = csv.reader(lines)
    header = next(reader, [])
    origins, start = [], reader.line_num + 1
    for record in reader:
        if record and len(record) > len(header):
            raise UserError(
                f"{where}.dataset: '{path}', line {start}: {len(record)} fields, but the header (line 1) "
                f"names {len(header)} ({', '.join(header)}); quote values that hold a comma."
            )
        if record:
            origins.append(f"line {start} of {path}")
        start = reader.line_num + 1
    return origins


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


def file_rows(dataset) -> list:
    """For each row of a loaded dataset, where it is in the data as written: 'line L of FILE' for a local
    .jsonl/.csv file, else its 0-based row. `shuffle` and `limit` keep that mapping (datasets' indices
    mapping), so an error can name the row a user can find. `row_name` turns either into words."""
    mapping = getattr(dataset, "_indices", None)
    rows = mapping.column(0).to_pylist() if mapping is not None else list(range(len(dataset)))
    origins = getattr(dataset, "row_origins", None)
    return [origins[i] for i in rows] if origins else rows


# Rows converted from Arrow to Python at a time by `dataset_rows` and `column_values`: one batch's objects
# are held, not the dataset's. `for row in dataset` (and `dataset[column]`, a lazy column since datasets 4)
# slices and formats every row on its own, which is most of what reading a few thousand rows costs.
ROWS_PER_READ = 1024


def dataset_rows(dataset) -> Iterator[dict]:
    """Each row of a loaded dataset as a dict, in the order and with the values `for row in dataset` gives
    (after `shuffle` and `limit`), read `ROWS_PER_READ` rows at a time."""
    for batch in dataset.iter(batch_size=ROWS_PER_READ):
        yield from (dict(zip(batch, values)) for values in zip(*batch.values()))


def column_values(dataset, column: str) -> Iterator[Any]:
    """The values of one column, in row order, read `ROWS_PER_READ` rows at a time."""
    for batch in dataset.select_columns([column]).iter(batch_size=ROWS_PER_READ):
        yield from batch[column]


def check_strings(dataset, columns: Sequence[str], where: str) -> None:
    """Every value in `columns` is a string, or a chat (a list of messages) in `messages` and where a chat
    may stand (`prompt`, `completion`)."""
    rows = file_rows(dataset)
    for column in columns:
        for index, value in zip(rows, column_values(dataset, column)):
            if column == "messages" or (isinstance(value, list) and column in ("prompt", "completion")):
                if problem := messages_problem(value):
                    raise UserError(f"{where}: {row_name(index)}, column '{column}': {problem}.")
            elif not isinstance(value, str):
                raise UserError(
                    f"{where}: {row_name(index)}, column '{column}' is {type(value).__name__} {value!r}, not a string."
                )


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a chat (a list of {'role': one of CHAT_ROLES, 'content': str}), or None."""
    if not isinstance(messages, list):
        return f"expected a list of chat messages, got {type(messages).__name__} {str(messages)[:60]!r}"
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            return f"a chat message is not {{'role': str, 'content': str}}: {str(message)[:80]!r}"
        if message["role"] not in CHAT_ROLES:
            return (
                f"chat role '{message['role']}'{did_you_mean(message['role'], CHAT_ROLES)} is not one chat "
                f"templates know ({', '.join(CHAT_ROLES)})"
            )
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""
