"""Recipe loading and validation: interpolation, references, overrides and the error for each bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALLEST_MODEL, run_cli, run_cli_here, write_recipe

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.run.runner import make_context, stage_record


def base_recipe(tmp_path: Path, **stages) -> dict:
    return {
        "name": "r",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 3,
        "stages": stages or {"sft": {"data": {"task": "arithmetic", "n": 10}}},
    }


def error_of(tmp_path: Path, recipe: dict, overrides=()) -> str:
    with pytest.raises(UserError) as caught:
        load_recipe(write_recipe(tmp_path, recipe), overrides)
    return str(caught.value)


def test_valid_recipe_resolves_interpolation_references_and_defaults(tmp_path):
    recipe = base_recipe(
        tmp_path,
        sft={"data": {"task": "arithmetic", "n": 10}},
        sft2={"kind": "sft", "model": "${sft}", "data": {"task": "arithmetic", "n": 5}},
    )
    recipe["output_dir"] = str(tmp_path / "runs" / "${name}")
    recipe["lora"] = {"r": 4}
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    assert loaded.out == tmp_path / "runs" / "r"
    assert loaded.start_model("sft") == str(loaded.out / "base")
    assert loaded.start_model("sft2") == str(loaded.out / "sft")
    assert loaded.stages["sft2"].kind == "sft"
    assert loaded.lora_for("sft2").r == 4


def test_stage_lora_null_overrides_recipe_default(tmp_path):
    recipe = base_recipe(tmp_path, sft={"data": {"task": "arithmetic", "n": 10}, "lora": None})
    recipe["lora"] = {"r": 4}
    assert load_recipe(write_recipe(tmp_path, recipe)).lora_for("sft") is None


def test_stage_record_shows_the_lora_the_stage_trained_with(tmp_path):
    """A stage without its own `lora:` trains with the recipe's; stage.json's config (and so the model
    card) says so, and a stage that turned LoRA off says null."""
    recipe = base_recipe(
        tmp_path,
        inherits={"kind": "sft", "data": {"task": "arithmetic", "n": 5}},
        full={"kind": "sft", "data": {"task": "arithmetic", "n": 5}, "lora": None},
    )
    recipe["lora"] = {"r": 4, "lora_alpha": 8}
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    inherited = stage_record(make_context(loaded, "inherits"), {})["config"]["lora"]
    assert inherited == loaded.lora.model_dump(mode="json") and inherited["r"] == 4
    assert stage_record(make_context(loaded, "full"), {})["config"]["lora"] is None


def test_previous_policy_stage_is_the_default_start(tmp_path):
    recipe = base_recipe(
        tmp_path,
        a={"kind": "sft", "data": {"task": "arithmetic", "n": 5}},
        b={"kind": "sft", "data": {"task": "arithmetic", "n": 5}},
    )
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    assert loaded.start_model("b") == str(loaded.out / "a")


def test_dotted_overrides_change_values(tmp_path):
    loaded = load_recipe(
        write_recipe(tmp_path, base_recipe(tmp_path)),
        ["stages.sft.train.learning_rate=1e-4", "seed=7", "stages.sft.data.n=3"],
    )
    assert loaded.stages["sft"].train["learning_rate"] == pytest.approx(1e-4)
    assert loaded.seed == 7
    assert loaded.stages["sft"].data.task_params().n == 3


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r.update(modle="x"), ["unknown key 'modle'", "did you mean 'model'"]),
        (lambda r: r["stages"]["sft"].update(trian={}), ["stages.sft.trian", "did you mean 'train'"]),
        (lambda r: r.update(seed="abc"), ["'seed'", "integer"]),
        (
            lambda r: r["stages"].update(x={"kind": "sftt"}),
            ["unknown stage kind 'sftt'", "did you mean 'sft'", "available kinds"],
        ),
        (
            lambda r: r["stages"].update(x={"kind": "sft", "model": "${nope}", "data": {"task": "arithmetic"}}),
            ["stages.x.model", "'${nope}'", "not a stage"],
        ),
        (
            lambda r: (
                r["stages"]["sft"].update(model="${later}")
                or r["stages"].update(later={"kind": "sft", "data": {"task": "arithmetic"}})
            ),
            ["runs later", "move 'later' above 'sft'"],
        ),
        (
            lambda r: (
                r["stages"]["sft"].update(model="${b}")
                or r["stages"].update(b={"kind": "sft", "model": "${sft}", "data": {"task": "arithmetic"}})
            ),
            ["reference cycle", "sft -> b -> sft"],
        ),
        (
            lambda r: r["stages"]["sft"].update(data={"task": "arithmetic", "digitz": 2}),
            ["digitz", "did you mean 'digits'"],
        ),
        (lambda r: r["stages"]["sft"].update(data={"dataset": "x.jsonl", "colums": 1}), ["'colums'"]),
        (lambda r: r["stages"]["sft"].update(data={"split": "train"}), ["exactly one of 'dataset'"]),
        (lambda r: r.update(stages={}), ["stages"]),
        (lambda r: r.update(output_dir="${nothere}/x"), ["interpolation", "nothere"]),
    ],
    ids=[
        "top-key",
        "stage-key",
        "wrong-type",
        "unknown-kind",
        "undefined-ref",
        "forward-ref",
        "cycle",
        "task-param",
        "data-key",
        "no-source",
        "no-stages",
        "bad-interpolation",
    ],
)
def test_each_bad_recipe_names_its_culprit(tmp_path, mutate, expected):
    recipe = base_recipe(tmp_path)
    mutate(recipe)
    message = error_of(tmp_path, recipe)
    for fragment in expected:
        assert fragment in message, message


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nstages:\n  sft: {data: [\n")
    with pytest.raises(UserError, match=r"bad.yaml: YAML syntax error at line \d+"):
        load_recipe(path)


def test_duplicate_stage_ids_are_rejected(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: x\nmodel: m\nstages:\n  sft: {kind: sft}\n  sft: {kind: sft}\n")
    with pytest.raises(UserError, match=r"duplicate key 'sft' at line 5 \(first at line 4\)"):
        load_recipe(path)


def test_merge_key_override_is_not_a_duplicate(tmp_path):
    from alignment.config.recipe import _parse_yaml

    path = tmp_path / "anchors.yaml"
    path.write_text("base: &base {x: 1, y: 2}\nother:\n  <<: *base\n  x: 3\n")
    assert _parse_yaml(path)["other"] == {"x": 3, "y": 2}


@pytest.mark.parametrize("override", ["noequals", "=3", "a.b=[1,"])
def test_bad_override_syntax(tmp_path, override):
    with pytest.raises(UserError, match="bad override"):
        load_recipe(write_recipe(tmp_path, base_recipe(tmp_path)), [override])


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_check_cli_reports_bad_trl_knob_without_traceback(tmp_path):
    recipe = base_recipe(tmp_path, sft={"data": {"task": "arithmetic", "n": 10}, "train": {"learning_rat": 1e-4}})
    result = run_cli_here("check", write_recipe(tmp_path, recipe))
    assert result.returncode == 2
    assert "stages.sft.train: unknown SFTConfig option 'learning_rat' (did you mean 'learning_rate'?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_cli_reports_missing_column_and_missing_file(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "a", "completion": "b"}\n')
    recipe = base_recipe(tmp_path, sft={"data": {"dataset": str(data)}})
    result = run_cli_here("check", write_recipe(tmp_path, recipe))
    assert result.returncode == 2, result.stderr
    assert "missing column(s) 'prompt'" in result.stderr and "Columns present: question, completion" in result.stderr
    recipe = base_recipe(tmp_path, sft={"data": {"dataset": str(tmp_path / "absent.jsonl")}})
    result = run_cli_here("check", write_recipe(tmp_path, recipe, "r2.yaml"))
    assert result.returncode == 2 and "absent.jsonl' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_cli_accepts_a_valid_recipe(tmp_path):
    result = run_cli("check", write_recipe(tmp_path, base_recipe(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def suites_recipe(tmp_path: Path) -> dict:
    recipe = base_recipe(tmp_path)
    recipe["evaluate"] = {
        "suites": [{"name": "a", "data": {"task": "arithmetic", "split": "test", "n": 5}, "verifier": "arithmetic"}]
    }
    return recipe


def test_override_indexes_a_list(tmp_path):
    loaded = load_recipe(
        write_recipe(tmp_path, suites_recipe(tmp_path)),
        ["evaluate.suites.0.data.n=3", "evaluate.suites.0.name=renamed"],
    )
    suite = loaded.evaluate.suites[0]
    assert suite.name == "renamed" and suite.data.task_params().n == 3


@pytest.mark.parametrize(
    "override, expected",
    [
        ("evaluate.suites.1.name=x", ["index 1 is out of range", "'evaluate.suites' has 1 item(s)"]),
        ("evaluate.suites.first.name=x", ["'evaluate.suites' is a list", "not 'first'"]),
    ],
)
def test_override_bad_list_index_names_the_key(tmp_path, override, expected):
    message = error_of(tmp_path, suites_recipe(tmp_path), [override])
    assert message.startswith(f"bad override '{override}'"), message
    for fragment in expected:
        assert fragment in message, message


def test_override_mapping_replaces_the_recipes_mapping(tmp_path):
    """`rename={}` on the command line empties the recipe's mapping (a merge would keep every entry)."""
    recipe = base_recipe(tmp_path, sft={"data": {"dataset": "d.jsonl", "rename": {"q": "prompt", "a": "completion"}}})
    path = write_recipe(tmp_path, recipe)
    assert load_recipe(path, ["stages.sft.data.rename={}"]).stages["sft"].data.rename == {}
    assert load_recipe(path, ["stages.sft.data.rename={a: completion}"]).stages["sft"].data.rename == {
        "a": "completion"
    }
    assert load_recipe(path, ["stages.sft.data.rename.x=y"]).stages["sft"].data.rename == {
        "q": "prompt",
        "a": "completion",
        "x": "y",
    }
