"""Tests for verify_file: scoring a JSONL/CSV file of completions."""

import csv
import json

import pytest

from alignment.errors import UserError
from alignment.verifiers.report import verify_file


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


ROWS = [
    {"completion": "#### 4", "answer": "4", "id": 1},
    {"completion": "#### 5", "answer": "4", "id": 2},
    {"completion": "no idea", "answer": "4", "id": 3},
    {"completion": "#### 4", "answer": "n/a", "id": 4},  # bad gold -> error row
    {"completion": "2 + 2 = 4", "answer": 4, "id": 5},
]


def test_jsonl_summary_and_examples(tmp_path):
    report = verify_file("numeric", write_jsonl(tmp_path / "s.jsonl", ROWS))
    assert report["n"] == 5 and report["pass_rate"] == 0.4
    assert report["unparseable_rate"] == 0.2 and report["error_rate"] == 0.2
    examples = report["examples"]
    assert [e["row"] for e in examples["passed"]] == [1, 5]
    assert [e["row"] for e in examples["failed"]] == [2]
    assert [e["row"] for e in examples["unparseable"]] == [3]
    assert examples["error"][0]["row"] == 4 and "ValueError" in examples["error"][0]["detail"]
    assert report["verifier"] == "numeric" and report["column"] == "completion"
    json.dumps(report)  # the CLI writes it as JSON


def test_where_scores_the_matching_rows_and_keeps_file_row_numbers(tmp_path):
    rows = [{**row, "mode": "main" if row["id"] in (2, 5) else "pass_k"} for row in ROWS]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    report = verify_file("numeric", path, where={"mode": "main"})
    assert report["n"] == 2 and report["pass_rate"] == 0.5 and report["where"] == {"mode": "main"}
    assert [e["row"] for e in report["examples"]["passed"]] == [5]
    assert [e["row"] for e in report["examples"]["failed"]] == [2]
    assert verify_file("numeric", path, where={"id": "5"})["n"] == 1  # a JSON number matches its text
    with pytest.raises(UserError, match="no row has mode=mian; 'mode' holds main, pass_k"):
        verify_file("numeric", path, where={"mode": "mian"})
    with pytest.raises(UserError, match="no row has a column 'modus'"):
        verify_file("numeric", path, where={"modus": "main"})


def test_examples_are_capped_at_three(tmp_path):
    rows = [{"completion": "#### 1", "answer": 1}] * 10
    report = verify_file("numeric", write_jsonl(tmp_path / "s.jsonl", rows))
    assert len(report["examples"]["passed"]) == 3 and report["n"] == 10


def test_csv_and_custom_column_and_options(tmp_path):
    path = tmp_path / "s.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["output", "answer"])
        writer.writeheader()
        writer.writerows([{"output": "The answer is 4", "answer": "4"}, {"output": "#### 4", "answer": "4"}])
    report = verify_file("gsm8k", path, column="output", options={"mode": "strict"})
    assert report["pass_rate"] == 0.5 and report["unparseable_rate"] == 0.5


def test_json_list_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(ROWS[:2]))
    assert verify_file("numeric", path)["n"] == 2


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda p: p / "missing.jsonl", "File not found"),
        (lambda p: (p / "s.txt").write_text("x") and p / "s.txt", "unsupported file type '.txt'"),
        (lambda p: (p / "e.jsonl").write_text("") is not None and p / "e.jsonl", "has no rows"),
        (lambda p: (p / "b.jsonl").write_text('{"a": 1}\n{oops\n') and p / "b.jsonl", r"line 2: not valid JSON"),
        (lambda p: (p / "l.jsonl").write_text("[1, 2]\n") and p / "l.jsonl", "row 1: expected a JSON object"),
    ],
)
def test_bad_files(tmp_path, setup, match):
    with pytest.raises(UserError, match=match):
        verify_file("numeric", setup(tmp_path))


def test_missing_columns_name_the_existing_ones(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"completions": "#### 4", "answer": 4}])
    expected = r"column 'completion' is missing.*Did you mean 'completions'.*answer, completions"
    with pytest.raises(UserError, match=expected):
        verify_file("numeric", path)
    path = write_jsonl(tmp_path / "t.jsonl", [{"completion": "#### 4", "gold": 4}])
    with pytest.raises(UserError, match=r"column 'answer' is missing.*Columns in the file: completion, gold"):
        verify_file("numeric", path)


def test_user_verifier_from_search_dir(tmp_path):
    (tmp_path / "report_verifiers_mod.py").write_text("def short(completion):\n    return float(len(completion) < 5)\n")
    path = write_jsonl(tmp_path / "s.jsonl", [{"completion": "hi"}, {"completion": "a long one"}])
    report = verify_file("report_verifiers_mod:short", path, search_dirs=[tmp_path])
    assert report["pass_rate"] == 0.5
