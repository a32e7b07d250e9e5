"""Local data files: `split` and `config` where they apply (and errors where they cannot), and rows named by
their file and line as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from alignment.config.data import DataSpec
from alignment.data.loading import file_rows, load_rows
from alignment.errors import UserError


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_of(name: str, n: int) -> list[dict]:
    return [{"prompt": f"{name} {i}", "completion": "a"} for i in range(n)]


def load(dataset: Path, **spec):
    return load_rows(DataSpec(dataset=str(dataset), shuffle=False, **spec), seed=0)


def test_a_folder_split_is_the_file_named_after_it(tmp_path):
    write_rows(tmp_path / "data" / "train_sft.jsonl", rows_of("train", 3))
    write_rows(tmp_path / "data" / "test_sft.jsonl", rows_of("test", 2))
    assert load(tmp_path / "data", split="train_sft")["prompt"] == ["train 0", "train 1", "train 2"]
    assert load(tmp_path / "data", split="test_sft")["prompt"] == ["test 0", "test 1"]
    # without `split`, datasets' own rule: train_sft.jsonl is the 'train' split, and test rows stay out
    assert load(tmp_path / "data")["prompt"] == ["train 0", "train 1", "train 2"]


def test_a_folder_split_of_hub_style_shards(tmp_path):
    import datasets

    folder = tmp_path / "data"
    folder.mkdir()
    for split, n in (("train_prefs", 4), ("test_prefs", 1)):
        datasets.Dataset.from_list(rows_of(split, n)).to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    assert len(load(folder, split="train_prefs")) == 4
    assert load(folder, split="test_prefs")["prompt"] == ["test_prefs 0"]


def test_a_folder_of_unsplit_files_is_all_train(tmp_path):
    write_rows(tmp_path / "data" / "part_a.jsonl", rows_of("a", 2))
    write_rows(tmp_path / "data" / "part_b.jsonl", rows_of("b", 2))
    assert len(load(tmp_path / "data")) == 4


def test_a_single_file_takes_its_own_name_as_split(tmp_path):
    path = write_rows(tmp_path / "test.jsonl", rows_of("t", 2))
    assert len(load(path, split="test")) == 2
    assert len(load(path, split="train")) == 2
    with pytest.raises(UserError, match=r"data.split: 'validation' cannot apply to the single file '.*test.jsonl'"):
        load(path, split="validation")


def test_config_on_local_data_is_an_error(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", rows_of("t", 2))
    with pytest.raises(UserError, match=r"data.config: 'en' cannot apply to the local file '.*d.jsonl'"):
        load(path, config="en")
    with pytest.raises(UserError, match=r"data.config: 'en' cannot apply to the local folder"):
        load(tmp_path, config="en")


def test_rows_are_named_by_file_and_line_after_shuffle_and_limit(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n\n" for r in rows_of("r", 5)))  # blank lines between rows
    dataset = load_rows(DataSpec(dataset=str(path), limit=3), seed=1)
    lines = {f"line {2 + 2 * i} of {path}": f"r {i}" for i in range(5)}
    assert [lines[origin] for origin in file_rows(dataset)] == dataset["prompt"]


def test_csv_rows_are_named_by_the_line_they_start_on(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,completion\n"two\nlines",a\n\nb,c\n')
    assert file_rows(load(path)) == [f"line 2 of {path}", f"line 5 of {path}"]


def test_in_memory_rows_keep_their_index():
    import datasets

    assert file_rows(datasets.Dataset.from_list(rows_of("m", 3)).select([2, 0])) == [2, 0]


def test_rows_read_a_batch_at_a_time_are_the_rows_one_at_a_time_and_errors_name_the_line(tmp_path, monkeypatch):
    """`dataset_rows`/`column_values` (what the checks read rows with) give what row iteration gives, in the
    shuffled order across batches, and a bad row in a later batch is named by its line in the file."""
    from alignment.data import loading
    from alignment.training.pairs import normalize_pairs
    from alignment.training.prompts import check_prompt_rows

    monkeypatch.setattr(loading, "ROWS_PER_READ", 4)
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": f"q {i}", "completion": "a", "chosen": "yes", "rejected": f"no {i}"} for i in range(30)]
    spec = DataSpec(dataset=str(path), limit=20)  # shuffled by default, then limited: an indices mapping
    write_rows(path, rows)
    dataset = load_rows(spec, seed=1)
    assert list(loading.dataset_rows(dataset)) == [dict(row) for row in dataset]
    assert list(loading.column_values(dataset, "prompt")) == list(dataset["prompt"])
    line = int(file_rows(dataset)[9].split()[1])  # the row read tenth: in the third batch
    bad = re.escape(f"line {line} of {path}")
    for column, value, check, message in [
        ("completion", 7, lambda d: loading.check_strings(d, ["prompt", "completion"], "data"), "'completion' is int"),
        ("prompt", " ", lambda d: check_prompt_rows(d, [], "data"), "the prompt is empty"),
        ("rejected", 5, lambda d: normalize_pairs(d, "data"), "column 'rejected'"),
    ]:
        write_rows(path, [{**r, column: value} if i == line - 1 else r for i, r in enumerate(rows)])
        with pytest.raises(UserError, match=rf"data: {bad}[,:] .*{message}"):
            check(load_rows(spec, seed=1))
