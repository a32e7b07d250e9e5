"""Which code `python_tests` runs when a completion holds prose and several blocks (issue #28 item 4):
the gold MBPP solution in the shapes models write it must pass, a wrong one must still fail, and
example usage (printing, raising, looping, its own asserts) must not decide. Rows are MBPP rows
(`text`, `code`, `test_list`), scored as a recipe maps them: ``rename: {test_list: tests}``.

Runs in the best isolation mode this machine offers (as tests/test_sandbox.py does).
"""

from dataclasses import dataclass

import pytest

from alignment.verifiers import resolve
from alignment.verifiers.python_tests import extract_code

OPTIONS = {"timeout": 3.0, "memory_mb": 256, "max_processes": 16, "allow_unsandboxed": True}
# MBPP task 2, as the dataset has it
MBPP = {
    "task_id": 2,
    "text": "Write a function to find the shared elements from the given two lists.",
    "code": "def similar_elements(test_tup1, test_tup2):\r\n"
    "  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) ",
    "test_list": [
        "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
        "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
        "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))",
    ],
}
GOLD = "def similar_elements(test_tup1, test_tup2):\n    res = tuple(set(test_tup1) & set(test_tup2))\n    return res\n"
WRONG = "def similar_elements(test_tup1, test_tup2):\n    return tuple(test_tup1)\n"
USAGE = "# Example usage\nresult = similar_elements((3, 4, 5, 6), (5, 7, 4, 10))\nprint(result)  # Output: (4, 5)\n"


def fence(code, lang="python"):
    return f"```{lang}\n{code}```"


@dataclass(frozen=True)
class Row:
    name: str
    completion: str
    reward: float


ROWS = [
    Row(
        "gold_then_example_usage_block",
        f"Here is the function:\n\n{fence(GOLD)}\n\nExample usage:\n\n{fence(USAGE)}\n\nThis prints (4, 5).",
        1.0,
    ),
    Row("prose_and_one_block", f"We intersect the two sets.\n{fence(GOLD)}\nThe result is a tuple.", 1.0),
    Row(
        "helper_in_an_earlier_block",
        fence("def common(a, b):\n    return set(a) & set(b)\n")
        + "\nThen:\n"
        + fence("def similar_elements(a, b):\n    return tuple(common(a, b))\n")
        + "\n"
        + fence(USAGE),
        1.0,
    ),
    Row(
        "import_in_its_own_block",
        fence("from functools import reduce\n")
        + "\n"
        + fence("def similar_elements(a, b):\n    return tuple(reduce(set.intersection, [set(a), set(b)]))\n"),
        1.0,
    ),
    Row("example_block_that_raises", fence(GOLD) + "\n" + fence("print(similar_elements((1, 2)))\n"), 1.0),
    Row(
        "example_block_that_loops",
        fence(GOLD) + "\n" + fence("while True:\n    print(similar_elements((1, 2), (2, 3)))\n"),
        1.0,
    ),
    Row(
        "example_block_with_its_own_wrong_assert",
        fence(GOLD) + "\n" + fence("assert similar_elements((1, 2), (2, 3)) == (3,)\n"),
        1.0,
    ),
    Row(
        "main_guard_reading_input",
        fence(
            GOLD + "\nif __name__ == '__main__':\n    a = input()\n"
            "    print(similar_elements(a, a))\n    raise SystemExit(1)\n"
        ),
        1.0,
    ),
    Row(
        "doctest_transcript_after_the_code",
        fence(GOLD)
        + "\n"
        + fence(">>> similar_elements((3, 4), (4, 5))\n(4,)\n>>> similar_elements((1,), (2,))\n()\n"),
        1.0,
    ),
    Row(
        "doctest_transcript_that_defines_the_function",
        fence(
            ">>> def similar_elements(a, b):\n...     return tuple(set(a) & set(b))\n...\n"
            ">>> similar_elements((3, 4), (4, 5))\n(4,)\n"
        ),
        1.0,
    ),
    Row("code_and_transcript_in_one_block", fence(GOLD + "\n>>> similar_elements((3, 4), (4, 5))\n(4,)\n"), 1.0),
    Row(
        "doctests_in_a_docstring_are_code",
        fence(
            'def similar_elements(a, b):\n    """\n    >>> similar_elements((3, 4), (4, 5))\n    (4,)\n    """\n'
            "    return tuple(set(a) & set(b))\n"
        ),
        1.0,
    ),
    Row(
        "untagged_code_then_untagged_output",
        fence(GOLD, "") + "\nOutput:\n" + fence("The shared elements are (4, 5)\n", ""),
        1.0,
    ),
    Row("shell_block_then_python_block", fence("pip install nothing\n", "bash") + "\n" + fence(GOLD), 1.0),
    Row("later_definition_wins", "A first try:\n" + fence(WRONG) + "\nThat is wrong; fixed:\n" + fence(GOLD), 1.0),
    Row(
        "example_block_sets_what_the_code_reads",
        fence(
            "def build():\n    return {'op': lambda a, b: tuple(set(a) & set(b))}\n"
            "def similar_elements(a, b):\n    return TABLE['op'](a, b)\n"
        )
        + "\n"
        + fence("TABLE = build()\n"),
        1.0,
    ),
    Row(
        "example_block_reuses_a_local_name_of_the_solution",
        fence("def similar_elements(a, b):\n    result = tuple(set(a) & set(b))\n    return result\n")
        + "\n"
        + fence("result = similar_elements((1, 2))\nprint(result)\n"),
        1.0,
    ),
    Row("unclosed_last_block", fence(GOLD) + "\n```python\nprint(similar_elements((1, 2), (2, 3)))\n", 1.0),
    # the tests still decide
    Row("wrong_then_example_usage", fence(WRONG) + "\n" + fence(USAGE), 0.0),
    Row("right_then_wrong_redefinition", fence(GOLD) + "\n" + fence(WRONG), 0.0),
    Row(
        "usage_block_that_rebinds_the_tested_name",
        fence(GOLD) + "\n" + fence("similar_elements = lambda a, b: similar_elements\n"),
        0.0,
    ),
    Row("usage_inside_the_defining_block_runs_as_written", fence(GOLD + "print(similar_elements((1, 2)))\n"), 0.0),
    Row("broken_tagged_block", fence(GOLD) + "\n" + fence("def oops(:\n"), 0.0),
]


def mbpp_example(row: dict) -> dict:
    """The row as the verifier sees it after the recipe's `rename: {test_list: tests}`."""
    example = dict(row)
    example["tests"] = example.pop("test_list")
    return example


@pytest.fixture(scope="module")
def verifier():
    return resolve("python_tests", options=OPTIONS)


def test_gold_mbpp_code_passes_its_own_tests(verifier):
    assert verifier.score(fence(MBPP["code"]), mbpp_example(MBPP)).reward == 1.0


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_reward(row, verifier):
    result = verifier.score(row.completion, mbpp_example(MBPP))
    assert (result.reward, result.status) == (row.reward, "ok"), result.detail


def test_program_is_the_blocks_a_reader_runs():
    completion = fence(GOLD) + "\n" + fence(USAGE) + "\n" + fence(">>> similar_elements((1,), (1,))\n(1,)\n")
    assert extract_code(completion, "assert similar_elements((1,), (1,)) == (1,)") == (GOLD, True)
    transcript = fence(">>> x = 1\n>>> for i in range(2):\n...     x += i\n...\n>>> x\n2\n")
    assert extract_code(transcript) == ("x = 1\nfor i in range(2):\n    x += i\n\nx\n", True)
    assert extract_code("no code here") == ("no code here", False)  # no fence: the whole text, as before
    assert extract_code(fence("   \n")) == (None, True)
