"""The bands of the generated tasks (alignment/tasks/splits.py): `validation_fraction` reserves problems that are
neither test nor training ones, leaves the test rows as they were, and is required by `split: validation`;
reasoning-gym's log line counts a task's distinct questions where they are fewer than its rows.

    python -m pytest tests/test_splits.py -q
"""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
from pydantic import ValidationError

from alignment.config.data import DataSpec
from alignment.errors import UserError
from alignment.tasks import get_task

needs_reasoning_gym = pytest.mark.skipif(find_spec("reasoning_gym") is None, reason='needs pip install -e ".[tasks]"')
SPECS = [
    pytest.param({"task": "arithmetic", "n": 300}, id="arithmetic"),
    pytest.param({"task": "tool_arithmetic", "n": 300}, id="tool_arithmetic"),
    pytest.param(
        {"task": "reasoning_gym", "n": 200, "tasks": {"gcd": {"config": {"max_value": 50}}, "chain_sum": 1}},
        id="reasoning_gym",
        marks=needs_reasoning_gym,
    ),
]


def rows(spec: dict, split: str, seed: int = 3, **keys) -> list[dict]:
    return get_task(spec["task"]).build(DataSpec.model_validate({**spec, **keys}).task_params(), split, seed)


def problems(spec: dict, split: str, seed: int = 3, **keys) -> set[str]:
    """The problems of a split, as text: the prompt of arithmetic's rows, the question of reasoning-gym's."""
    found = rows(spec, split, seed, **keys)
    return {json.loads(r["rg_entry"])["question"] if "rg_entry" in r else str(r["prompt"]) for r in found}


@pytest.mark.parametrize("spec", SPECS)
def test_the_validation_band_is_disjoint_from_test_and_training_and_leaves_the_test_rows_as_they_were(spec):
    validation = problems(spec, "validation", validation_fraction=0.2)
    test, train = problems(spec, "test", validation_fraction=0.2), problems(spec, "train", validation_fraction=0.2)
    assert validation and not validation & test and not validation & train and not test & train
    # Another seed draws its validation problems from the same band: still none of this seed's test problems.
    assert not problems(spec, "validation", seed=4, validation_fraction=0.2) & test
    # The band is carved out of the training problems: the test rows are the same with or without it.
    assert rows(spec, "test", validation_fraction=0.2) == rows(spec, "test")
    assert train != problems(spec, "train")  # ... and the training rows are not


@pytest.mark.parametrize("spec", SPECS)
def test_the_validation_split_without_a_band_is_an_error_that_names_the_setting(spec):
    with pytest.raises(UserError, match=rf"Task {spec['task']}, `split: validation`.*`validation_fraction`"):
        rows(spec, "validation")


def test_bands_that_leave_no_training_problems_are_a_config_error():
    with pytest.raises(ValidationError, match="test_fraction 0.5 \\+ validation_fraction 0.5 leave no training"):
        DataSpec.model_validate({"task": "arithmetic", "test_fraction": 0.5, "validation_fraction": 0.5})


@needs_reasoning_gym
def test_a_task_with_few_questions_is_logged_with_its_distinct_count(logged):
    # lcm of two numbers up to 20 has 400 questions, 30 of them in the test band: 60 rows repeat some.
    found = rows({"task": "reasoning_gym", "n": 60, "tasks": {"lcm": {"config": {"max_value": 20}}}}, "test")
    distinct = len({json.loads(r["rg_entry"])["question"] for r in found})
    assert distinct < 60 and f"reasoning_gym (test questions): lcm 60 ({distinct} distinct)" in logged()
