"""The `reasoning_gym` task and verifier (alignment/tasks/reasoning_gym.py) on reasoning-gym's real generators.

Fast: rows of a weighted mix (shares, columns, demonstrations that score full credit), train and held-out rows
that never share a question, the verifier on hand-written completions (right, wrong, partial credit, no answer,
refused answers), metadata that survives its JSON column (ARC grids are tuples), config and name errors through
`align check` with a "did you mean", and the error without the package. Slow: an rlvr stage of two steps on a
tiny model with reasoning-gym prompts, and an evaluation suite scored by the verifier.

    python -m pytest tests/test_reasoning_gym.py -q -x
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from importlib.util import find_spec

import pytest
from conftest import TINY_MODEL, recipe_dict, run_cli_here, write_recipe
from pydantic import ValidationError

from alignment.config.data import DataSpec
from alignment.errors import UserError
from alignment.tasks import reasoning_gym as task
from alignment.verifiers import resolve

# The `tasks` extra; `dev` installs it, so CI runs these. find_spec: collecting the suite does not import it.
pytestmark = pytest.mark.skipif(find_spec("reasoning_gym") is None, reason='needs pip install -e ".[tasks]"')

MIX = {
    "leg_counting": 1,
    "spell_backward": {"weight": 2},
    "basic_arithmetic": {"weight": 1, "config": {"max_terms": 3}},
}


def params(**keys):
    return DataSpec.model_validate({"task": "reasoning_gym", "tasks": MIX, **keys}).task_params()


def question(row: dict) -> str:
    return json.loads(row["rg_entry"])["question"]


@pytest.fixture(scope="module")
def train_rows() -> list[dict]:
    return task.build(params(n=200), "train", 42)


def test_a_weighted_mix_gives_each_task_its_share_and_demonstrations_that_score_full_credit(train_rows):
    assert Counter(r["rg_task"] for r in train_rows) == {
        "leg_counting": 50,
        "spell_backward": 100,
        "basic_arithmetic": 50,
    }
    assert task._shares(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert task._shares(7, {"a": 1, "b": 6}) == {"a": 1, "b": 6}
    row = train_rows[0]
    assert set(row) == {"prompt", "completion", "answer", "rg_task", "rg_entry"}
    assert "<answer>" in row["prompt"] and row["prompt"].endswith(question(row))  # reasoning-gym's instruction first
    assert all(r["completion"] == f"<answer>{r['answer']}</answer>" for r in train_rows)
    assert all(task.verify(r["completion"], r["rg_entry"]) == 1.0 for r in train_rows)
    assert [r["rg_task"] for r in train_rows[:10]] != sorted(r["rg_task"] for r in train_rows[:10])  # interleaved
    terms = [
        json.loads(r["rg_entry"])["metadata"]["num_terms"] for r in train_rows if r["rg_task"] == "basic_arithmetic"
    ]
    assert max(terms) <= 3  # the task's own config reached its generator


def test_train_and_held_out_rows_never_share_a_question_and_are_reproducible(train_rows):
    held_out = task.build(params(n=100), "test", 42)
    assert len(held_out) == 100 and not {question(r) for r in held_out} & {question(r) for r in train_rows}
    assert task.build(params(n=200), "train", 42) == train_rows
    assert {question(r) for r in task.build(params(n=100), "eval", 42)} == {question(r) for r in held_out}
    assert {question(r) for r in task.build(params(n=200), "train", 7)} != {question(r) for r in train_rows}
    # The hash partition holds whatever the seed: another seed's held-out questions are no training question either.
    assert not {question(r) for r in task.build(params(n=100), "test", 7)} & {question(r) for r in train_rows}


def test_each_build_logs_its_shares_and_the_rows_no_demonstration_can_be_given(logged):
    task.build(params(n=6), "test", 1)  # exact shares 1.5, 3, 1.5: the tie's extra row goes to the first
    assert "reasoning_gym (test questions): leg_counting 2, spell_backward 3, basic_arithmetic 1" in logged()
    puzzles = task.build(params(tasks={"rush_hour": 1}, n=2), "train", 1)  # solutions are checked, not compared
    assert all(r["answer"] is None and r["completion"] is None for r in puzzles)
    assert "2 rows without a reference answer (no `completion`)" in logged()


def test_the_messages_format_puts_the_instruction_in_a_system_turn():
    rows = task.build(params(n=4, format="messages", system_prompt="direct"), "train", 1)
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert roles == [["system", "user", "assistant"]] * 4 and "prompt" not in rows[0]
    bare = task.build(params(n=2, system_prompt="none"), "train", 1)
    assert all(r["prompt"] == question(r) for r in bare)


def leg_row() -> dict:
    return task.build(
        DataSpec.model_validate({"task": "reasoning_gym", "tasks": {"leg_counting": 1}, "n": 1}).task_params(),
        "train",
        3,
    )[0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Cats have four legs... <answer>{answer}</answer>", 1.0),
        ("<answer>1</answer> no wait <answer>{answer}</answer>", 1.0),  # the last answer counts
        ("<answer>{wrong}</answer>", 0.0),
        ("<answer>{answer} legs</answer>", "partial"),  # reasoning-gym's substring credit: len(answer) / len(given)
        ("The answer is {answer}.", None),  # no tags: unparseable, not wrong
    ],
)
def test_the_verifier_scores_the_last_answer_tag_with_the_tasks_own_scorer(completion, expected):
    row = leg_row()
    answer = row["answer"]
    text = completion.format(answer=answer, wrong=int(answer) + 1)
    if expected == "partial":
        expected = len(answer) / len(f"{answer} legs")
    result = resolve("reasoning_gym").score(text, row)
    assert result.reward == pytest.approx(expected or 0.0)
    assert result.status == ("unparseable" if expected is None else "ok")


def test_answers_that_could_reach_python_are_error_rows_not_scores():
    verifier = resolve("reasoning_gym")
    for answer in ("__import__('os').getcwd()", "9" * (task.MAX_ANSWER_CHARS + 1)):
        result = verifier.score(f"<answer>{answer}</answer>", leg_row())
        assert result.status == "error" and "not handed to reasoning-gym's scorer" in result.detail


def test_metadata_survives_its_json_column():
    nested = {"grid": ((1, 2), (3, 4)), "seen": {5}, 7: "int key", "__odd__": [None, True, 1.5]}
    assert task._decode(json.loads(json.dumps(task._encode(nested)))) == nested
    arc = task.build(
        DataSpec.model_validate({"task": "reasoning_gym", "tasks": {"arc_agi": 1}, "n": 2}).task_params(), "train", 1
    )
    assert all(task.verify(r["completion"], r["rg_entry"]) == 1.0 for r in arc)  # its scorer compares tuples


def test_bad_task_configs_are_errors_that_name_the_key():
    with pytest.raises(ValidationError, match="seed: set from the recipe's seed"):
        params(tasks={"leg_counting": {"config": {"seed": 1}}})
    with pytest.raises(ValidationError, match="greater than 0"):
        params(tasks={"leg_counting": 0})
    with pytest.raises(UserError, match="no config key 'min_animal' \\(did you mean 'min_animals'\\?\\)"):
        task.build(params(tasks={"leg_counting": {"config": {"min_animal": 2}}}), "train", 1)
    with pytest.raises(UserError, match="refused its config"):
        task.build(params(tasks={"leg_counting": {"config": {"min_animals": 0}}}), "train", 1)


def test_align_check_names_an_unknown_task_with_a_did_you_mean(tmp_path):
    stage = {
        "data": {"task": "reasoning_gym", "tasks": {"leg_countin": 1}, "n": 8},
        "verifiers": ["reasoning_gym"],
        "train": {"max_steps": 1, "num_generations": 4, "per_device_train_batch_size": 8},
    }
    done = run_cli_here("check", write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", stage)))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unknown reasoning-gym task 'leg_countin' (did you mean 'leg_counting'?)" in done.stderr
    assert "Traceback" not in done.stderr


def test_without_the_package_a_recipe_naming_it_is_told_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(UserError, match=r'pip install -e "\.\[tasks\]"'):
        task.build(params(n=2), "train", 1)
    with pytest.raises(UserError, match=r'pip install -e "\.\[tasks\]"'):
        resolve("reasoning_gym").score("<answer>1</answer>", {"rg_entry": "{}"})


@pytest.mark.slow
def test_sft_and_rlvr_train_on_reasoning_gym_rows_and_a_suite_scores_with_the_verifier(tmp_path):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe, run_recipe

    data = {"task": "reasoning_gym", "tasks": {"leg_counting": 1, "spell_backward": 1}, "system_prompt": "none"}
    sft = {"data": {**data, "n": 16}, "train": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 256}}
    rlvr = {
        "kind": "rlvr",
        "data": {**data, "n": 16},
        "verifiers": ["reasoning_gym"],
        "train": {
            "max_steps": 2,
            "num_generations": 4,
            "per_device_train_batch_size": 8,
            "max_completion_length": 8,
            "logging_steps": 1,
            "learning_rate": 1.0e-4,
        },
    }
    suite = {
        "name": "rg",
        "data": {**data, "split": "test", "n": 6},
        "verifier": "reasoning_gym",
        "sampling": {"temperature": 0, "max_new_tokens": 8},
    }
    spec = recipe_dict(tmp_path, "sft", sft, TINY_MODEL, evaluate={"suites": [suite]})
    spec["stages"]["rlvr"] = rlvr
    recipe = load_recipe(write_recipe(tmp_path, spec))
    check_recipe(recipe)
    results = run_recipe(recipe)
    assert results["sft"]["metrics"]["global_step"] == 2 and results["rlvr"]["metrics"]["global_step"] == 2
    history = json.loads((recipe.stage_dir("rlvr") / "log_history.json").read_text())
    assert any("rewards/reasoning_gym/mean" in h for h in history)
    metrics = json.loads((recipe.out / "eval" / "metrics.json").read_text())["checkpoints"]
    assert all({"rg/pass@1", "rg/unparseable_rate"} <= set(metrics[stage]) for stage in ("sft", "rlvr"))
