"""Tools in the stages: `tools:`/`environment:`/`max_turns` on rlvr through TRL's rollout_func (our multi-turn
rollout, tool tokens masked), what `align check` refuses, and the shipped tools recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMALLEST_MODEL, write_recipe

from alignment.tools.formats import Call, ToolFormat

TRAIN = {"max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 48,
         "logging_steps": 1, "learning_rate": 1.0e-4}


def recipe(tmp_path: Path, **stage) -> dict:
    return {"name": "tools-test", "model": SMALLEST_MODEL, "output_dir": str(tmp_path / "out"), "seed": 1,
            "stages": {"rlvr": {"data": {"task": "arithmetic", "split": "train", "n": 32}, "verifiers": ["arithmetic"],
                                "tools": ["calculator"], "tool_format": "hermes", "max_turns": 3,
                                "max_tool_output_tokens": 16, "train": TRAIN, **stage}}}


def test_rlvr_trains_on_multi_turn_rollouts_with_tool_results(tmp_path, monkeypatch):
    """The random tiny model writes no calls; every closed turn is read as a calculator call, so the rollouts
    that end their turns run several turns with tool results between them, through GRPO's update."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    monkeypatch.setattr(ToolFormat, "parse", lambda self, text: ([Call("calculator", {"expression": "2*3"})], []))
    loaded = load_recipe(write_recipe(tmp_path, recipe(tmp_path)))
    metrics = run_recipe(loaded)["rlvr"]
    metrics = metrics.get("metrics", metrics)
    assert metrics["tools/rollouts"] == 16  # 2 steps x 8 completions
    assert metrics["tools/turns"] >= metrics["tools/rollouts"]
    saved = json.loads((loaded.stage_dir("rlvr") / "tools.json").read_text())
    assert saved["tool_format"] == "hermes" and saved["tools"][0]["function"]["name"] == "calculator"
    history = json.loads((loaded.stage_dir("rlvr") / "log_history.json").read_text())
    assert any("tools/call_rate" in entry for entry in history)


@pytest.mark.parametrize("stage, message", [
    ({"tools": ["nonesuch"]}, "stages.rlvr.tools.0: Unknown tool 'nonesuch'"),
    ({"tool_format": None}, "tool_format"),
    ({"algorithm": "rloo"}, "tools need algorithm: grpo"),
    ({"environment": "nowhere:Env"}, "stages.rlvr.environment"),
    ({"tools": [], "max_turns": 3, "tool_format": None, "max_tool_output_tokens": 16}, "only apply with `tools:`"),
])
def test_align_check_validates_the_tool_keys(tmp_path, stage, message):
    """What `align check` runs (load_recipe + check_recipe), in process."""
    from alignment.config.recipe import load_recipe
    from alignment.errors import UserError
    from alignment.run.runner import check_recipe

    with pytest.raises(UserError) as error:
        check_recipe(load_recipe(write_recipe(tmp_path, recipe(tmp_path, **stage))))
    assert message in str(error.value)


def test_partitioned_engines_are_refused_before_loading(monkeypatch):
    from alignment.config.stages.rlvr import Config
    from alignment.errors import UserError
    from alignment.training import tool_rollouts

    monkeypatch.setattr(tool_rollouts, "launched_engine", lambda: "zero3")
    config = Config(data={"task": "arithmetic"}, verifiers=["arithmetic"], tools=["calculator"])
    with pytest.raises(UserError, match="do not run under zero3"):
        tool_rollouts.check_engine(config, "stages.rlvr")
