"""Reward-model ensembles (`ensemble:` on a reward stage; Coste et al. 2023): the combinations by hand, the stage
trains its members from their own seeds and writes a folder every reader of `reward_model:` scores with, and bad
folders or settings are named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import write_recipe
from transformers import AutoModelForSequenceClassification

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.models.loading import load_reward_model
from alignment.models.reward_ensemble import (
    RewardEnsemble,
    combine_scores,
    read_marker,
    read_standardisation,
    standardised,
)
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import make_context, run_recipe
from alignment.stages import reward
from alignment.training.scoring import check_reward_model, score_texts

SCORES = torch.tensor([[1.0, 2.0], [3.0, 0.0], [2.0, 4.0]])  # 3 members x 2 answers


def test_combinations_by_hand():
    assert combine_scores(SCORES, "mean").tolist() == [2.0, 2.0]
    assert combine_scores(SCORES, "min").tolist() == [1.0, 0.0]
    # population variances: answer 0 (1, 3, 2) -> 2/3, answer 1 (2, 0, 4) -> 8/3
    assert combine_scores(SCORES, "uwo", penalty=0.5).tolist() == pytest.approx([2 - 1 / 3, 2 - 4 / 3])
    assert combine_scores(SCORES, "uwo", penalty=0.0).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="median"):
        combine_scores(SCORES, "median")


def member(path: str):
    """One member alone (`load_reward_model` of the stage's folder reads the whole ensemble)."""
    return AutoModelForSequenceClassification.from_pretrained(path).eval()


def ensemble_context(tmp_path, model, ensemble, **stage):
    stage = {
        "kind": "reward",
        "data": {"task": "arithmetic", "n": 40},
        "eval_fraction": 0.25,
        "train": {"max_steps": 3, "per_device_train_batch_size": 8, "learning_rate": 1.0e-3},
        "ensemble": ensemble,
        **stage,
    }
    recipe = {
        "name": "ens",
        "model": str(model),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": None,
        "stages": {"rm": stage},
    }
    return make_context(load_recipe(write_recipe(tmp_path, recipe)), "rm")


def test_the_stage_trains_each_member_from_its_own_seed_and_scores_with_their_combination(tmp_path, tiny_model):
    ctx = ensemble_context(tmp_path, tiny_model, {"members": 3, "combine": "uwo", "penalty": 0.5})
    metrics = reward.run(ctx)["metrics"]

    members, combine, penalty = read_marker(ctx.out_dir)
    assert (combine, penalty) == ("uwo", 0.5) and len(members) == 3
    assert members[0] == str(ctx.out_dir.resolve()) and all("members" in m for m in members[1:])
    heads = [member(m).score.weight for m in members]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])  # own seeds
    assert {f"member_{i}/eval_accuracy" for i in range(3)} <= set(metrics) and "eval_accuracy" in metrics

    model, tokenizer = load_reward_model(str(ctx.out_dir)), load_tokenizer(str(ctx.out_dir))
    assert isinstance(model, RewardEnsemble) and len(model.members) == 3
    prompts, answers = ["What is 12+7?", "What is 40+3?", "What is 5+5?"], ["19", "44", "10"]
    each = torch.tensor([score_texts(member(m), tokenizer, prompts, answers) for m in members])
    combined = score_texts(model, tokenizer, prompts, answers)
    stats = read_standardisation(ctx.out_dir, 3)  # each member's mean and std on the stage's held-out pairs
    assert stats is not None and stats != pytest.approx([stats[0]] * 3)
    aligned = standardised(each, stats)
    assert combined == pytest.approx((aligned.mean(0) - 0.5 * aligned.var(0, unbiased=False)).tolist(), abs=1e-5)
    assert combined != pytest.approx(each[0].tolist(), abs=1e-4)  # not one member's score
    check_reward_model("${rm}", str(ctx.out_dir), "stages.ppo.reward_model")


def test_a_missing_member_or_a_bad_marker_is_named(tmp_path, tiny_model):
    ctx = ensemble_context(tmp_path, tiny_model, {"members": 2}, eval_fraction=0)
    reward.run(ctx)
    moved = tmp_path / "moved"
    shutil.copytree(ctx.out_dir, moved)
    shutil.rmtree(moved / "members")
    with pytest.raises(UserError, match=r"member\(s\) .*members/1 do not exist"):
        load_reward_model(str(moved))
    with pytest.raises(UserError, match="do not exist"):
        check_reward_model("${rm}", str(moved), "stages.ppo.reward_model")
    (moved / "reward_ensemble.json").write_text(json.dumps({"members": ["."], "combine": "median", "penalty": 0}))
    with pytest.raises(UserError, match="combine must be one of mean, min, uwo"):
        load_reward_model(str(moved))


@pytest.mark.parametrize(
    "ensemble, message",
    [
        ({"members": 1}, "ensemble.members"),
        ({"members": 3, "penalty": 0.5}, "'penalty' weighs the members' variance in combine: uwo"),
        ({"members": 3, "combine": "median"}, "ensemble.combine"),
        ({"members": 3, "seeds": 2}, "seeds"),
    ],
)
def test_bad_ensemble_settings_are_named(tmp_path, tiny_model, ensemble, message):
    with pytest.raises(UserError, match=message):
        ensemble_context(tmp_path, tiny_model, ensemble)


def test_ppo_rsft_and_evaluation_read_the_ensemble(tmp_path, tiny_model):
    """A recipe whose reward model is an ensemble: ppo is rewarded, rsft selects and evaluation reports with
    the combined score."""
    stages = {
        "rm": {
            "kind": "reward",
            "data": {"task": "arithmetic", "n": 40},
            "eval_fraction": 0,
            "train": {"max_steps": 2, "per_device_train_batch_size": 8},
            "ensemble": {"members": 2, "combine": "min"},
        },
        "rsft": {
            "reward_model": "${rm}",
            "data": {"task": "arithmetic", "split": "train", "n": 8},
            "sampling": {"n": 2, "max_new_tokens": 4, "temperature": 1.0},
            "train": {"max_steps": 1, "per_device_train_batch_size": 8, "max_length": 64},
        },
        "ppo": {
            "policy": str(tiny_model),
            "reward_model": "${rm}",
            "data": {"task": "arithmetic", "n": 8},
            "rollout": {"batch_size": 8, "max_new_tokens": 4},
            "train": {"total_updates": 1, "mini_batch_size": 8, "ppo_epochs": 1, "save_every": 100},
        },
    }
    evaluate = {
        "after": ["ppo"],
        "reward_model": "${rm}",
        "suites": [
            {
                "name": "arithmetic",
                "data": {"task": "arithmetic", "split": "test", "n": 4},
                "verifier": "arithmetic",
                "sampling": {"temperature": 0, "max_new_tokens": 4},
            }
        ],
    }
    recipe = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "ens",
                "model": str(tiny_model),
                "output_dir": str(tmp_path / "out"),
                "seed": 1,
                "lora": None,
                "stages": stages,
                "evaluate": evaluate,
            },
        )
    )
    run_recipe(recipe)
    selected = [
        json.loads(line) for line in (recipe.stage_dir("rsft") / "selected_round1.jsonl").read_text().splitlines()
    ]
    rm = load_reward_model(str(recipe.stage_dir("rm")))
    tokenizer = load_tokenizer(str(recipe.stage_dir("rm")))
    scored = score_texts(rm, tokenizer, [r["prompt"] for r in selected], [r["completion"] for r in selected])
    assert [r["score"] for r in selected] == pytest.approx(scored, abs=1e-5)  # the min over the two members
    assert "rm_score" in json.loads((recipe.stage_dir("ppo") / "log_history.json").read_text())[0]
    evaluated = json.loads((recipe.out / "eval" / "metrics.json").read_text())["checkpoints"]
    assert isinstance(evaluated["ppo"]["arithmetic/rm_score"], float)
