"""`dpo` stage: the loss matches a hand computation, the reference is the start policy without a second
copy (LoRA), EOS is not doubled, precomputed reference log-probs run, the shipped sft-dpo recipe
validates, and DPO from the SFT fixture raises held-out accuracy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import NEAR_ANSWER, REPO, heldout_accuracy, write_recipe
from helpers import completion_logprob, count_parameter_storage

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.run.runner import make_context


def dpo_context(tmp_path, model, lora=True, data=None, train=None, **stage):
    recipe = {
        "name": "dpo-test",
        "model": str(model),
        "output_dir": str(tmp_path / "out"),
        "seed": 3,
        "lora": {"r": 8, "lora_alpha": 16} if lora else None,
        "stages": {
            "dpo": {
                "data": data or {"task": "arithmetic", "split": "train", "n": 6},
                "train": {
                    "per_device_train_batch_size": 6,
                    "max_steps": 1,
                    "logging_steps": 1,
                    "beta": 0.5,
                    "learning_rate": 1.0e-3,
                    **(train or {}),
                },
                **stage,
            }
        },
    }
    return make_context(load_recipe(write_recipe(tmp_path, recipe)), "dpo")


def hand_dpo_loss(policy, reference, tokenizer, rendered: list[dict], beta: float) -> float:
    losses = []
    for row in rendered:
        chosen = completion_logprob(policy, tokenizer, row["prompt"], row["chosen"]) - completion_logprob(
            reference, tokenizer, row["prompt"], row["chosen"]
        )
        rejected = completion_logprob(policy, tokenizer, row["prompt"], row["rejected"]) - completion_logprob(
            reference, tokenizer, row["prompt"], row["rejected"]
        )
        losses.append(-torch.nn.functional.logsigmoid(beta * (chosen - rejected)))
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_loss_matches_hand_computation(tmp_path, tiny_model, lora):
    """At step 0 policy == reference and the loss is log 2, which proves little. So the policy is moved
    first (LoRA: a non-zero adapter; full: perturbed weights) and the reference is computed from a fresh
    load of the start model: the trainer's loss, and its first logged loss, must match the formula."""
    from alignment.models.loading import load_policy
    from alignment.stages import dpo
    from alignment.training.pairs import normalize_pairs, render_pairs

    ctx = dpo_context(tmp_path, tiny_model, lora=lora)
    trainer, tokenizer, _ = dpo.build_trainer(ctx)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if (lora and "lora_B" in name) or (not lora and param.dim() == 2):
                param.add_(torch.randn_like(param) * (0.3 if lora else 0.05))
    pairs, _ = normalize_pairs(ctx.load_data(ctx.config.data), "data")
    rendered = render_pairs(tokenizer, pairs)
    reference = load_policy(ctx.start_model)
    trainer.model.eval()
    expected = hand_dpo_loss(trainer.model, reference, tokenizer, rendered, beta=0.5)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(rendered))]))
    with torch.no_grad():
        computed = float(trainer.compute_loss(trainer.model, batch))
    trainer.train()
    logged = trainer.state.log_history[0]["loss"]
    assert abs(expected - math.log(2)) > 0.02  # the test is not the trivial step-0 case
    assert computed == pytest.approx(expected, abs=1e-4)
    assert logged == pytest.approx(expected, abs=1e-3)


def test_lora_reference_is_the_same_weights_and_full_is_a_frozen_copy(tmp_path, tiny_model):
    from alignment.models.loading import load_policy
    from alignment.stages import dpo

    base = count_parameter_storage(load_policy(str(tiny_model)))
    trainer, _, _ = dpo.build_trainer(dpo_context(tmp_path / "lora", tiny_model, lora=True))
    lora_bytes = count_parameter_storage(trainer.model)
    assert trainer.ref_model is None
    assert lora_bytes < 1.2 * base  # base weights + a small adapter, no second copy
    trainer, _, _ = dpo.build_trainer(dpo_context(tmp_path / "full", tiny_model, lora=False))
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    full_bytes = count_parameter_storage(trainer.model, trainer.ref_model)
    assert full_bytes >= 1.9 * base
    trainer, _, _ = dpo.build_trainer(
        dpo_context(tmp_path / "pre", tiny_model, lora=False, train={"precompute_ref_log_probs": True})
    )
    assert trainer.ref_model is None  # precomputed reference log-probs: no copy kept


def test_precompute_ref_log_probs_runs(tmp_path, tiny_model):
    from alignment.stages import dpo

    ctx = dpo_context(
        tmp_path, tiny_model, train={"precompute_ref_log_probs": True, "max_steps": 2, "per_device_train_batch_size": 3}
    )
    trainer, _, _ = dpo.build_trainer(ctx)
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(trainer.train_dataset.column_names)
    trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(trainer.state.log_history[-1]["train_loss"])


@pytest.mark.parametrize(
    "train, precomputed",
    [
        ({"max_steps": -1}, True),  # TRL's default of 3 epochs: one reference pass instead of three
        ({"max_steps": -1, "num_train_epochs": 2}, True),
        ({"max_steps": -1, "num_train_epochs": 1}, False),  # one pass: nothing to save
        ({"max_steps": 20, "num_train_epochs": 3}, False),  # a step budget may not cover the data once
        ({"max_steps": -1, "precompute_ref_log_probs": False}, False),  # the recipe's choice wins
    ],
    ids=["default", "2-epochs", "1-epoch", "max-steps", "recipe-off"],
)
def test_reference_log_probs_are_precomputed_when_training_passes_more_than_once(
    tmp_path, tiny_model, train, precomputed
):
    from alignment.stages import dpo

    assert dpo.trl_config(dpo_context(tmp_path, tiny_model, train=train)).precompute_ref_log_probs is precomputed


def test_answers_end_with_one_end_of_turn_token(tmp_path, tiny_model):
    """A tokenizer whose EOS differs from the template's end-of-turn token (Qwen base: <|endoftext|> vs
    <|im_end|>) must not get EOS appended after our rendered end-of-turn token."""
    import shutil

    from transformers import AutoTokenizer

    from alignment.stages import dpo

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = "<|system|>"  # <|end|> stays a special token that closes each turn, as <|im_end|> does
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>"]})
    tokenizer.save_pretrained(folder)
    trainer, tokenizer, _ = dpo.build_trainer(dpo_context(tmp_path, folder))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    for row in trainer.train_dataset:
        assert row["chosen_ids"][-1] == end and end not in row["chosen_ids"][:-1]
        assert row["rejected_ids"][-1] == end and tokenizer.eos_token_id not in row["rejected_ids"]


def test_bad_settings_fail_in_check(tmp_path, tiny_model):
    from alignment.stages import dpo

    with pytest.raises(
        UserError, match=r"stages.dpo.train.loss_type: unknown DPO loss 'sigmod'.*did you mean 'sigmoid'"
    ):
        dpo.check(dpo_context(tmp_path / "a", tiny_model, train={"loss_type": "sigmod"}))
    with pytest.raises(UserError, match=r"stages.dpo.data: missing column\(s\) 'rejected'"):
        dpo.check(
            dpo_context(
                tmp_path / "b", tiny_model, data={"task": "arithmetic", "n": 4, "rename": {"rejected": "wrong"}}
            )
        )
    with pytest.raises(UserError, match=r"Unknown verifier 'arithmetik'"):
        dpo.check(dpo_context(tmp_path / "c", tiny_model, on_policy={"verifier": "arithmetik"}))


def test_sft_dpo_recipe_validates_and_builds_its_trl_configs(tmp_path):
    """The shipped GPU recipe cannot download offline; its schema and TRL configs are checked instead."""
    from alignment.stages import stage_module

    recipe = load_recipe(
        REPO / "recipes" / "qwen2.5-0.5b" / "sft-dpo.yaml", overrides=[f"output_dir={tmp_path / 'out'}"]
    )
    assert recipe.model == "Qwen/Qwen2.5-0.5B" and list(recipe.stages) == ["sft", "dpo"]
    assert recipe.stages["dpo"].model == "${sft}" and recipe.lora is not None
    for stage_id, config in recipe.stages.items():
        args = stage_module(config.kind).trl_config(make_context(recipe, stage_id))
    assert args.beta == pytest.approx(0.1) and args.loss_type == ["sigmoid"]


def run_dpo(tmp_path, start, stage: dict, lora: dict | None = None) -> tuple[Path, dict]:
    from alignment.run.runner import run_recipe

    recipe = {
        "name": "dpo-run",
        "model": str(start),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": lora or {"r": 16, "lora_alpha": 32},
        "stages": {"dpo": stage},
    }
    results = run_recipe(load_recipe(write_recipe(tmp_path, recipe)))
    return tmp_path / "out" / "dpo", results["dpo"]["metrics"]


def test_on_policy_pairs_are_built_counted_and_trained_on(tmp_path, early_sft_checkpoint):
    stage = {
        "data": {"task": "arithmetic", "split": "train", "n": 24},
        "on_policy": {**NEAR_ANSWER, "n": 6, "temperature": 1.0, "max_new_tokens": 6},
        "train": {"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1},
    }
    out, metrics = run_dpo(tmp_path, early_sft_checkpoint, stage)
    assert metrics["pairs_built"] > 0 and metrics["pairs_built"] + metrics["prompts_dropped"] == 24
    assert metrics["pairs_train"] == metrics["pairs_built"] and metrics["global_step"] == 2
    assert (out / "stage.json").exists() and (out / "adapter").is_dir()


@pytest.mark.slow
def test_dpo_from_sft_raises_heldout_accuracy(tmp_path, sft_checkpoint):
    """RPO-style DPO (sigmoid DPO + NLL on the chosen answer, Pang et al. 2024) on the built-in pairs.

    Measured on this task (200 held-out problems, SFT start 0.57): this recipe 0.945 (LoRA) / 0.985
    (full); NLL alone 0.995; pure sigmoid DPO 0.49 (LoRA, lr 5e-4) or 0.0 (full, lr 1e-3); on-policy
    verifier pairs with pure DPO 0.58. The pairs differ in one digit, so plain DPO lowers the chosen
    answer's likelihood along with the rejected one and greedy decoding drifts to a third answer
    (likelihood displacement, Razin et al. 2024); the NLL term prevents that and supplies the gain."""
    stage = {
        "data": {"task": "arithmetic", "split": "train", "n": 8000},
        "train": {
            "loss_type": ["sigmoid", "sft"],
            "loss_weights": [0.2, 1.0],
            "beta": 0.1,
            "learning_rate": 2.0e-3,
            "num_train_epochs": 1,
            "per_device_train_batch_size": 32,
            "max_length": 64,
            "precompute_ref_log_probs": True,
            "logging_steps": 50,
        },
    }
    out, metrics = run_dpo(tmp_path, sft_checkpoint, stage)
    before, after = heldout_accuracy(sft_checkpoint), heldout_accuracy(out)
    assert after >= before + 0.10
    assert metrics["rewards/margins"] > 0  # the preference term separates chosen from rejected


def test_pairs_longer_than_max_length_are_counted_and_said(tmp_path, tiny_model, caplog):
    import json
    import logging

    from alignment.stages import dpo

    rows = [{"prompt": f"What is {a}+1?", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(12)]
    rows += [{"prompt": "What is 1+1?", "chosen": "2", "rejected": "3, because " + "so it goes " * 10}] * 4
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = dpo_context(
        tmp_path,
        tiny_model,
        data={"dataset": str(data)},
        eval_fraction=0,
        train={"max_steps": 1, "per_device_train_batch_size": 4, "max_length": 48},
    )
    with caplog.at_level(logging.INFO, logger="alignment"):
        _, _, counts = dpo.build_trainer(ctx)
    assert counts["pairs_truncated"] == 4
    assert any(r.levelno == logging.WARNING and "4 of 16 pairs (25%)" in r.getMessage() for r in caplog.records)
