"""A dpo stage's output read as a reward model (`models.implicit_reward`): the score is beta times the
policy/reference log-ratio summed over the answer's tokens (hand-computed), the dpo stage writes what it
needs and a moved run folder still resolves, recipes may name a dpo stage (and no other policy stage) as
`reward_model:`, and ppo, rsft and evaluation score with it end to end.

    python -m pytest tests/test_implicit_reward.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import write_recipe
from helpers import completion_logprob, pairwise_accuracy

from alignment.config.recipe import load_recipe
from alignment.config.tasks import ArithmeticParams
from alignment.data.formatting import render_completion, render_prompt
from alignment.errors import UserError
from alignment.models.implicit_reward import (
    MARKER,
    ImplicitRewardModel,
    read_marker,
    write_marker,
)
from alignment.models.loading import load_policy, load_reward_model
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import run_recipe
from alignment.tasks.arithmetic import build
from alignment.training.scoring import check_reward_model, score_rendered, score_texts

QUESTIONS = ["What is 2+2?", "What is 13+29?", "What is 7+5?"]
ANSWERS = ["4", "The answer is 42", "12"]


def perturbed(model_dir, seed: int = 0):
    """The model at `model_dir` with every weight nudged: a policy that differs from its reference."""
    model = load_policy(str(model_dir))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def test_score_is_beta_times_the_log_ratio_summed_over_the_answer(tiny_model):
    tokenizer = load_tokenizer(str(tiny_model))
    policy, reference = perturbed(tiny_model), load_policy(str(tiny_model))
    judge = ImplicitRewardModel(policy, reference, beta=0.5)
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    answers = [render_completion(tokenizer, q, a) for q, a in zip(QUESTIONS, ANSWERS)]
    expected = [
        0.5 * float(completion_logprob(policy, tokenizer, p, a) - completion_logprob(reference, tokenizer, p, a))
        for p, a in zip(prompts, answers)
    ]
    assert all(abs(e) > 1e-3 for e in expected)  # the perturbation shows in every score
    # One batch (left-padded prompts of different lengths, right-padded answers) and one row a batch agree.
    assert score_texts(judge, tokenizer, QUESTIONS, ANSWERS, batch_size=16) == pytest.approx(expected, abs=1e-4)
    assert score_texts(judge, tokenizer, QUESTIONS, ANSWERS, batch_size=1) == pytest.approx(expected, abs=1e-4)


def test_a_cut_off_answer_scores_the_lower_of_as_sampled_and_finished(tiny_model):
    """Skipping the end-of-turn term never pays: a cut-off answer (an empty one too) scores no more than the same
    text finished, nor more than the text as sampled (an empty one: 0)."""
    tokenizer = load_tokenizer(str(tiny_model))
    policy, reference = perturbed(tiny_model), load_policy(str(tiny_model))
    judge = ImplicitRewardModel(policy, reference, beta=1.0)
    prompt = render_prompt(tokenizer, QUESTIONS[1])
    cut = float(
        completion_logprob(policy, tokenizer, prompt, "The ans")
        - completion_logprob(reference, tokenizer, prompt, "The ans")
    )
    scores = score_texts(judge, tokenizer, QUESTIONS[1:2] * 2, ["The ans", ""], finished=[False, False])
    ended = score_texts(judge, tokenizer, QUESTIONS[1:2] * 2, ["The ans", ""], finished=[True, True])
    assert scores == pytest.approx([min(cut, ended[0]), min(0.0, ended[1])], abs=1e-4)


def test_a_policy_equal_to_its_reference_scores_everything_zero(tiny_model):
    tokenizer = load_tokenizer(str(tiny_model))
    judge = ImplicitRewardModel(load_policy(str(tiny_model)), load_policy(str(tiny_model)), beta=0.1)
    assert score_texts(judge, tokenizer, QUESTIONS, ANSWERS) == pytest.approx([0.0] * 3, abs=1e-6)
    with pytest.raises(ValueError, match="score_texts"):  # no prompt/answer boundary in a rendered text
        score_rendered(judge, tokenizer, ["anything"])


def test_marker_resolves_from_the_final_folder_and_after_the_run_folder_moves(tmp_path, tiny_model):
    run = tmp_path / "run"
    shutil.copytree(tiny_model, run / "sft")
    staging, final = run / ".staging" / "dpo", run / "dpo"
    staging.mkdir(parents=True)
    write_marker(staging, str(run / "sft"), 0.1, final)
    staging.rename(final)
    assert json.loads((final / MARKER).read_text()) == {"reference": "../sft", "beta": 0.1}
    assert read_marker(final) == (str((run / "sft").resolve()), 0.1)
    moved = tmp_path / "elsewhere"
    run.rename(moved)
    assert read_marker(moved / "dpo") == (str((moved / "sft").resolve()), 0.1)
    shutil.rmtree(moved / "sft")
    with pytest.raises(UserError, match=r"'\.\./sft'.*does not exist"):
        read_marker(moved / "dpo")


def test_a_hub_reference_is_kept_as_written_and_a_bad_beta_is_refused(tmp_path):
    write_marker(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", 0.1)
    assert read_marker(tmp_path) == ("HuggingFaceTB/SmolLM2-135M-Instruct", 0.1)
    (tmp_path / MARKER).write_text(json.dumps({"reference": "x", "beta": 0}))
    with pytest.raises(UserError, match="beta must be a positive number"):
        read_marker(tmp_path)
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(UserError, match=f"{MARKER}.*run that stage again"):
        read_marker(tmp_path)


def recipe_with(tmp_path, model, stages: dict, evaluate: dict | None = None):
    recipe = {
        "name": "implicit",
        "model": str(model),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": stages,
    }
    if evaluate:
        recipe["evaluate"] = evaluate
    return write_recipe(tmp_path, recipe)


DPO = {
    "model": None,
    "data": {"task": "arithmetic", "split": "train", "n": 64},
    "eval_data": {"task": "arithmetic", "split": "test", "n": 16},
    "train": {
        "loss_type": ["sigmoid", "sft"],
        "loss_weights": [1.0, 0.2],
        "beta": 0.5,
        "learning_rate": 3.0e-3,
        "max_steps": 8,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "max_length": 64,
        "logging_steps": 4,
        "eval_strategy": "steps",
        "eval_steps": 8,
    },
}


@pytest.mark.parametrize("kind", ["sft", "ppo"])
def test_reward_model_must_name_a_reward_or_dpo_stage(tmp_path, tiny_model, kind):
    stages = {
        "sft": {"data": {"task": "arithmetic", "n": 8}},
        "dpo": {**DPO, "model": "${sft}"},
        "ppo": {"reward_model": "${dpo}", "data": {"task": "arithmetic", "n": 8}},
    }
    load_recipe(recipe_with(tmp_path, tiny_model, stages, {"reward_model": "${dpo}", "suites": ["arithmetic"]}))
    stages["ppo"]["reward_model"] = "${sft}"
    with pytest.raises(
        UserError,
        match=r"'stages\.ppo\.reward_model' names stage 'sft' \(kind sft\), which makes no "
        "reward model",
    ):
        load_recipe(recipe_with(tmp_path, tiny_model, stages))
    stages["ppo"]["reward_model"] = "${dpo}"
    with pytest.raises(UserError, match=r"evaluate\.reward_model names stage '(sft|ppo)'.*a reward or dpo stage"):
        load_recipe(recipe_with(tmp_path, tiny_model, stages, {"reward_model": kind, "suites": ["arithmetic"]}))


def test_dpo_output_is_a_reward_model_that_ppo_rsft_and_evaluation_score_with(tmp_path, early_sft_checkpoint):
    """dpo writes its marker; `align check`'s reward-model check accepts the folder; its implicit reward is the
    reward TRL's DPO evaluation reports; rsft selects by it, ppo is rewarded by it and evaluation reports it."""
    stages = {
        "dpo": {**DPO, "model": str(early_sft_checkpoint)},
        "rsft": {
            "model": str(early_sft_checkpoint),
            "reward_model": "${dpo}",
            "gold": ["arithmetic"],
            "data": {"task": "arithmetic", "split": "train", "n": 8},
            "select": "best_of_n",
            "sampling": {"n": 4, "max_new_tokens": 6, "temperature": 1.0},
            "train": {"max_steps": 1, "per_device_train_batch_size": 8, "max_length": 64},
        },
        "ppo": {
            "policy": str(early_sft_checkpoint),
            "reward_model": "${dpo}",
            "gold": ["arithmetic"],
            "data": {"task": "arithmetic", "split": "train", "n": 16},
            "rollout": {"batch_size": 8, "max_new_tokens": 6},
            "train": {"total_updates": 1, "mini_batch_size": 8, "ppo_epochs": 1, "save_every": 100},
        },
    }
    evaluate = {
        "after": ["ppo"],
        "reward_model": "${dpo}",
        "suites": [
            {
                "name": "arithmetic",
                "data": {"task": "arithmetic", "split": "test", "n": 8},
                "verifier": "arithmetic",
                "sampling": {"temperature": 0, "max_new_tokens": 8},
            }
        ],
    }
    recipe = load_recipe(recipe_with(tmp_path, early_sft_checkpoint, stages, evaluate))
    run_recipe(recipe)
    dpo_dir = recipe.stage_dir("dpo")

    assert read_marker(dpo_dir) == (str(early_sft_checkpoint.resolve()), 0.5)
    check_reward_model("${dpo}", str(dpo_dir), "stages.ppo.reward_model")
    judge = load_reward_model(str(dpo_dir))
    assert isinstance(judge, ImplicitRewardModel) and judge.beta == 0.5
    # TRL's evaluation after the last step computed the same rewards on the held-out pairs (the adapter unmerged).
    trl = [e for e in json.loads((dpo_dir / "log_history.json").read_text()) if "eval_rewards/chosen" in e][-1]
    pairs = build(ArithmeticParams(n=16), "test", seed=1)
    tokenizer = load_tokenizer(str(dpo_dir))
    chosen = score_texts(judge, tokenizer, [p["prompt"] for p in pairs], [p["chosen"] for p in pairs])
    rejected = score_texts(judge, tokenizer, [p["prompt"] for p in pairs], [p["rejected"] for p in pairs])
    assert abs(trl["eval_rewards/chosen"]) > 1e-3  # the policy moved
    assert sum(chosen) / 16 == pytest.approx(trl["eval_rewards/chosen"], abs=1e-4)
    assert sum(rejected) / 16 == pytest.approx(trl["eval_rewards/rejected"], abs=1e-4)
    assert pairwise_accuracy(judge, tokenizer, pairs)["accuracy"] == pytest.approx(trl["eval_rewards/accuracies"])

    selected = [
        json.loads(line) for line in (recipe.stage_dir("rsft") / "selected_round1.jsonl").read_text().splitlines()
    ]
    assert selected and any(r["score"] != 0 for r in selected)
    assert "rm_score" in json.loads((recipe.stage_dir("ppo") / "log_history.json").read_text())[0]
    evaluated = json.loads((recipe.out / "eval" / "metrics.json").read_text())["checkpoints"]
    assert isinstance(evaluated["ppo"]["arithmetic/rm_score"], float)
