"""Every shipped hub recipe (recipes/qwen2.5-0.5b/*.yaml), run for a step or two on local files laid out exactly
like its hub datasets (tests/hub_fixtures.py: the same columns and types, one file per split), with the model
swapped for a tiny one: the recipe's own data settings (rename, columns, verifiers, formats) are exercised end to
end, and each stage's stage.json says which data format it detected and which columns it trained on.

Local files: the loader of this branch reads every file of a folder as one `train` split, so each data spec
points at its split's file and drops `split` and `config` (the hub's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALLEST_MODEL, require_isolation, write_recipe
from hub_fixtures import DATASETS, write_hub_fixtures

from alignment.config.recipe import load_recipe
from alignment.run.runner import run_recipe

RECIPES = sorted((REPO / "recipes" / "qwen2.5-0.5b").glob("*.yaml"))

# Per stage kind: the `train:` keys that cut a stage to a step or two on a tiny model.
SHORT_TRAIN = {
    "sft": {
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_length": 256,
        "eval_steps": 1,
        "save_steps": 100,
        "logging_steps": 1,
    },
    "reward": {
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_length": 256,
        "logging_steps": 1,
    },
    "dpo": {
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_length": 256,
        "eval_steps": 1,
        "save_steps": 100,
        "logging_steps": 1,
    },
    "rsft": {
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_length": 256,
        "logging_steps": 1,
    },
    "rlvr": {
        "max_steps": 1,
        "num_generations": 2,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_completion_length": 8,
        "save_steps": 100,
        "logging_steps": 1,
    },
    "ppo": {
        "total_episodes": 2,
        "mini_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "ppo_epochs": 1,
        "warmup_steps": 0,
        "save_every": 100,
        "logging_steps": 1,
    },
}


def localize(spec: dict, folder: Path) -> dict:
    """A hub data spec pointing at its split's local file instead."""
    assert spec["dataset"] in DATASETS, f"no fixture for {spec['dataset']}: add it to tests/hub_fixtures.py"
    split = spec.pop("split", "train")
    spec.pop("config", None)
    assert split in DATASETS[spec["dataset"]][1], f"{spec['dataset']} has no split {split!r} on the hub"
    return {**spec, "dataset": str(folder / spec["dataset"] / f"{split}.jsonl")}


def shortened(path: Path, folder: Path, out: Path) -> dict:
    """The recipe at `path` on the fixtures, a tiny model and a step or two per stage."""
    recipe = yaml.safe_load(path.read_text())
    recipe.update(model=SMALLEST_MODEL, output_dir=str(out))
    for stage_id, stage in recipe["stages"].items():
        kind = stage.get("kind", stage_id)  # a stage without `kind` is of the kind it is named
        for key in ("data", "eval_data"):
            if key in stage:
                stage[key] = localize(stage[key], folder)
        stage["train"] = {**stage.get("train", {}), **SHORT_TRAIN[kind]}
        if kind == "ppo":
            stage["rollout"] = {**stage["rollout"], "batch_size": 2, "max_new_tokens": 4}
        if kind == "rsft":
            stage.update(rounds=1, sampling={**stage["sampling"], "n": 2, "max_new_tokens": 16, "batch_size": 8})
    for suite in (recipe.get("evaluate") or {}).get("suites", []):
        suite["data"] = {**localize(suite["data"], folder), "limit": 2}
        suite["sampling"] = {**suite.get("sampling", {}), "max_new_tokens": 8, "batch_size": 4}
    return recipe


# What each recipe's stages must have found in their data (stage.json's data_format): (stage, key, format words,
# columns used).
EXPECTED = {
    "sft-dpo": [
        ("sft", "data", "messages", ["messages"]),
        ("sft", "eval_data", "messages", ["messages"]),
        ("dpo", "data", "conversational", ["chosen", "rejected"]),
    ],
    "sft-rm-ppo": [
        ("sft", "data", "messages", ["messages"]),
        ("rm", "data", "conversational", ["chosen", "rejected"]),
        ("ppo", "data", "`prompt` column (text)", ["prompt"]),
    ],
    "gsm8k-grpo": [("rlvr", "data", "`prompt` column (text)", ["prompt", "answer"])],
    "math-grpo": [("rlvr", "data", "`prompt` column (text)", ["prompt", "answer"])],
    "code-rsft": [("rsft", "data", "`prompt` column (text)", ["prompt", "tests"])],
}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_hub_recipe_runs_on_local_files_laid_out_like_its_datasets(tmp_path, path):
    if path.stem == "code-rsft":
        require_isolation()  # without it python_tests refuses to run code, as designed
    folder = write_hub_fixtures(tmp_path / "hub")
    recipe = load_recipe(write_recipe(tmp_path, shortened(path, folder, tmp_path / "out")))
    run_recipe(recipe)
    for stage in recipe.stages:
        assert (recipe.stage_dir(stage) / "stage.json").exists(), stage
    for stage, key, words, columns in EXPECTED[path.stem]:
        record = json.loads((recipe.stage_dir(stage) / "stage.json").read_text())
        found = record["data_format"][key]
        assert words in found["format"] and found["columns"] == columns, (stage, key, found)
        assert f"**Data format ({key}):**" in (recipe.stage_dir(stage) / "README.md").read_text()
    if path.stem in ("sft-dpo", "sft-rm-ppo"):  # UltraChat: every conversation is multi-turn but one
        found = json.loads((recipe.stage_dir("sft") / "stage.json").read_text())["data_format"]["data"]
        assert found["conversations_multi_turn"] == 3 and found["ignored_columns"] == ["prompt", "prompt_id"]
    if recipe.evaluate is not None:
        assert (recipe.out / "eval" / "metrics.json").exists() or any(recipe.out.glob("**/metrics.json"))
