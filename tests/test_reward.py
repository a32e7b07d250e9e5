"""`reward` stage: a LoRA reward model from the SFT fixture learns arithmetic preferences (held-out pairwise
accuracy, score head trained), saves a loadable merged checkpoint, validates its data; chained recipe runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import NEAR_ANSWER, REPO, SMALLEST_MODEL, write_recipe
from helpers import pairwise_accuracy

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.run.runner import make_context

# ~110 LoRA steps from the SFT fixture (about 20 s on 2 idle cores).
RM_TRAIN = {
    "learning_rate": 1.0e-3,
    "num_train_epochs": 1,
    "per_device_train_batch_size": 32,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 5,
    "logging_steps": 10,
    "max_length": 64,
}


def reward_context(tmp_path, model, lora=True, **stage):
    stage = {"kind": "reward", "data": {"task": "arithmetic", "split": "train", "n": 4000}, "train": RM_TRAIN, **stage}
    recipe = {
        "name": "rm-test",
        "model": str(model),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": {"r": 16, "lora_alpha": 32} if lora else None,
        "stages": {"rm": stage},
    }
    return make_context(load_recipe(write_recipe(tmp_path, recipe)), "rm")


def score_head(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "score" in n and p.requires_grad}


def mistake_kind(pair: dict) -> str:
    delta = int(pair["rejected"]) - int(pair["chosen"])
    return {1: "+1", -1: "-1", 10: "+10", -10: "-10"}.get(delta, "reversed digits")


def accuracy_by_mistake_kind(model, tokenizer, pairs: list[dict]) -> dict[str, float]:

    kinds = sorted({mistake_kind(p) for p in pairs})
    return {
        kind: round(
            pairwise_accuracy(model, tokenizer, [p for p in pairs if mistake_kind(p) == kind], batch_size=64)[
                "accuracy"
            ],
            2,
        )
        for kind in kinds
    }


@pytest.mark.slow
def test_lora_reward_model_learns_arithmetic_preferences(tmp_path, sft_checkpoint):
    """The score head trains under LoRA and the saved model ranks held-out pairs above chance.

    Measured: held-out accuracy ~0.65-0.70 overall, ~0.97 on reversed-digit mistakes, near chance on +-1
    mistakes: in one short epoch at one learning rate the body does not learn to check a digit. The SFT
    policy's own log-probs rank the same pairs at ~0.90. recipes/arithmetic-reward-model.yaml, with a faster
    score head, reaches 0.945-0.988 (test_reward_model_recipe_checks_sums_on_held_out_pairs runs a third of it)."""
    from alignment.config.data import DataSpec
    from alignment.data.loading import load_rows
    from alignment.models.loading import load_reward_model
    from alignment.models.tokenizer import load_tokenizer
    from alignment.stages import reward
    from alignment.training.pairs import normalize_pairs

    ctx = reward_context(tmp_path, sft_checkpoint)
    trainer, counts = reward.build_trainer(ctx)
    before = score_head(trainer.model)
    assert before, "the score head must be trainable under LoRA (task_type SEQ_CLS -> modules_to_save)"
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "q_proj.base_layer" in n}
    trainer.train()
    after = score_head(trainer.model)
    changed = {n: float((after[n] - before[n]).abs().max()) for n in before}
    assert all(v > 0 for v in changed.values())
    assert all(torch.equal(p, dict(trainer.model.named_parameters())[n]) for n, p in frozen.items())
    reward.save_reward_model(trainer.model, trainer.processing_class, ctx.out_dir)

    model, tokenizer = load_reward_model(str(ctx.out_dir)), load_tokenizer(str(ctx.out_dir))
    held_out, _ = normalize_pairs(load_rows(DataSpec(task="arithmetic", split="test", n=400), seed=7), "test")
    overall = pairwise_accuracy(model, tokenizer, held_out, batch_size=64)
    by_kind = accuracy_by_mistake_kind(model, tokenizer, held_out)
    # Above chance (0.5) by three standard errors of a coin flip over these pairs (0.075 for 400): a margin set
    # by the sample size, not by one machine's run; the measured 0.65-0.70 clears it by 3 to 5 standard errors.
    assert overall["accuracy"] >= 0.5 + 3 * math.sqrt(0.25 / len(held_out)), overall
    assert by_kind["reversed digits"] >= 0.8, by_kind
    assert (ctx.out_dir / "adapter").is_dir() and model.config.num_labels == 1


@pytest.mark.slow
def test_reward_model_recipe_checks_sums_on_held_out_pairs(tmp_path, sft_checkpoint):
    """recipes/arithmetic-reward-model.yaml's `rm` stage for 1000 of its 4500 steps (2 of its 9 epochs, the
    schedule over the shorter run), from the SFT fixture: the body learns the digit check, >= 0.75 held-out
    pairwise accuracy on (correct, plausible mistake) pairs, where one learning rate for head and body stalls at
    0.6-0.75; score head changed. Measured: 0.8825 (seed 1; 0.908 and 0.850 on seeds 1 and 2 before the
    recipe left its validation band out of training). The whole recipe is a benchmark, not a test
    (`align run recipes/arithmetic-reward-model.yaml`; docs/results.md)."""
    from alignment.config.data import DataSpec
    from alignment.config.recipe import load_recipe as load
    from alignment.data.loading import load_rows
    from alignment.models.loading import load_reward_model
    from alignment.models.tokenizer import load_tokenizer
    from alignment.stages import reward
    from alignment.training.pairs import normalize_pairs

    shipped = load(REPO / "recipes" / "arithmetic-reward-model.yaml").stages["rm"]
    stage = shipped.model_dump(exclude_none=True, exclude={"model", "kind", "lora"})
    stage["train"] = {**stage["train"], "num_train_epochs": 2}
    ctx = reward_context(tmp_path, sft_checkpoint, lora=False, **stage)
    trainer, counts = reward.build_trainer(ctx)
    before = score_head(trainer.model)
    trainer.train()
    after = score_head(trainer.model)
    assert all(not torch.equal(after[n], before[n]) for n in before)
    reward.save_reward_model(trainer.model, trainer.processing_class, ctx.out_dir)

    model, tokenizer = load_reward_model(str(ctx.out_dir)), load_tokenizer(str(ctx.out_dir))
    held_out, _ = normalize_pairs(load_rows(DataSpec(task="arithmetic", split="test", n=400), seed=7), "test")
    overall = pairwise_accuracy(model, tokenizer, held_out, batch_size=64)
    assert overall["accuracy"] >= 0.75


def test_full_reward_model_saves_and_loads(tmp_path, tiny_model):
    from alignment.models.loading import load_reward_model
    from alignment.models.tokenizer import load_tokenizer
    from alignment.stages import reward
    from alignment.training.scoring import score_texts

    ctx = reward_context(
        tmp_path,
        tiny_model,
        lora=False,
        data={"task": "arithmetic", "n": 40},
        train={"max_steps": 2, "per_device_train_batch_size": 8},
        eval_fraction=0.25,
    )
    result = reward.run(ctx)
    assert result["metrics"]["pairs_eval"] == 10 and "eval_accuracy" in result["metrics"]
    model, tokenizer = load_reward_model(str(ctx.out_dir)), load_tokenizer(str(ctx.out_dir))
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert len(score_texts(model, tokenizer, ["What is 1+1?"] * 2, ["2", "3"])) == 2


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_score_head_trains_at_its_own_learning_rate(tmp_path, tiny_model, lora):
    from alignment.stages import reward

    ctx = reward_context(
        tmp_path,
        tiny_model,
        lora=lora,
        data={"task": "arithmetic", "n": 32},
        train={
            "max_steps": 2,
            "per_device_train_batch_size": 8,
            "learning_rate": 1.0e-4,
            "weight_decay": 0.01,
            "lr_scheduler_type": "constant",
        },
        eval_fraction=0,
        score_learning_rate=3.0e-2,
    )
    trainer, _ = reward.build_trainer(ctx)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    trainer.train()
    rates = {}
    for group in trainer.optimizer.param_groups:
        for param in group["params"]:
            rates[names[id(param)]] = group["lr"]
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(rates) == trainable, "every trainable parameter is optimised, once"
    head = {n for n in rates if reward.is_score_head(n)}
    assert head and all(rates[n] == 3.0e-2 for n in head)
    assert all(rates[n] == 1.0e-4 for n in rates if n not in head)


def test_score_learning_rate_without_a_score_head_is_named(tiny_model):
    from alignment.models.loading import load_policy
    from alignment.stages.reward import give_score_head_its_rate

    model = load_policy(str(tiny_model))  # a causal LM: no score head
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UserError, match="score_learning_rate is set, but the model has no trainable score head"):
        give_score_head_its_rate(optimizer, model, 1e-2)


def test_check_names_bad_data(tmp_path, tiny_model):
    from alignment.stages import reward

    ctx = reward_context(tmp_path / "a", tiny_model, data={"task": "arithmetic", "n": 4, "rename": {"chosen": "good"}})
    with pytest.raises(UserError, match=r"stages.rm.data: missing column\(s\) 'chosen'"):
        reward.check(ctx)
    rows = tmp_path / "same.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}) for _ in range(3)))
    with pytest.raises(
        UserError,
        match=r"stages.rm.data: no usable preference pairs: all 3 rows were dropped "
        r"\(3 chosen identical to rejected\)",
    ):
        reward.check(reward_context(tmp_path / "b", tiny_model, data={"dataset": str(rows)}))
    with pytest.raises(UserError, match=r"needs column\(s\) 'answer'"):
        reward.check(
            reward_context(
                tmp_path / "c",
                tiny_model,
                data={"task": "arithmetic", "n": 4, "rename": {"answer": "solution"}},
                on_policy={"verifier": "arithmetic"},
            )
        )


def test_chained_recipe_sft_then_reward_and_dpo_and_rerun_skips(tmp_path):
    from alignment.models.loading import load_reward_model
    from alignment.run.runner import run_recipe

    tiny = {"max_steps": 3, "per_device_train_batch_size": 8, "logging_steps": 1}
    recipe = {
        "name": "chain",
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": {
            "sft": {"data": {"task": "arithmetic", "n": 40}, "train": {**tiny, "max_length": 32}},
            "rm": {"kind": "reward", "model": "${sft}", "data": {"task": "arithmetic", "n": 40}, "train": tiny},
            "dpo": {"model": "${sft}", "data": {"task": "arithmetic", "n": 40}, "train": tiny},
        },
    }
    path = write_recipe(tmp_path, recipe)
    results = run_recipe(load_recipe(path))
    out = tmp_path / "out"
    for stage in ("sft", "rm", "dpo"):
        assert (out / stage / "stage.json").exists()
    assert json.loads((out / "dpo" / "stage.json").read_text())["start_model"] == str(out / "sft")
    assert json.loads((out / "rm" / "stage.json").read_text())["start_model"] == str(out / "sft")
    assert "eval_accuracy" in results["rm"]["metrics"] and results["dpo"]["metrics"]["pairs_train"] == 40
    load_reward_model(str(out / "rm"))
    stamp = (out / "dpo" / "stage.json").stat().st_mtime_ns
    assert run_recipe(load_recipe(path)) == {}  # every stage finished: all skipped
    assert (out / "dpo" / "stage.json").stat().st_mtime_ns == stamp


def test_align_merge_of_a_reward_adapter_writes_a_reward_model_with_its_trained_head(tmp_path, tiny_model):
    from transformers import AutoConfig

    from alignment.cli import main
    from alignment.models.loading import load_reward_model
    from alignment.models.tokenizer import load_tokenizer
    from alignment.stages import reward
    from alignment.training.scoring import score_texts

    ctx = reward_context(
        tmp_path,
        tiny_model,
        data={"task": "arithmetic", "n": 32},
        train={"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1.0e-2},
        eval_fraction=0,
    )
    reward.run(ctx)
    main(["merge", str(ctx.out_dir / "adapter"), str(tmp_path / "merged")])
    config = AutoConfig.from_pretrained(str(tmp_path / "merged"))
    assert config.architectures[0].endswith("ForSequenceClassification") and config.num_labels == 1
    tokenizer = load_tokenizer(str(ctx.out_dir))
    prompts, answers = ["What is 1+1?", "What is 2+5?"], ["2", "9"]
    stage_scores = score_texts(load_reward_model(str(ctx.out_dir)), tokenizer, prompts, answers)
    merged_scores = score_texts(load_reward_model(str(tmp_path / "merged")), tokenizer, prompts, answers)
    assert merged_scores == pytest.approx(stage_scores, abs=1e-4)


def test_pairs_longer_than_max_length_are_dropped_counted_and_said(tmp_path, tiny_model, caplog):
    import logging

    from alignment.stages import reward

    rows = [{"prompt": f"What is {a}+1?", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(20)]
    rows += [{"prompt": "What is 1+1? " + "Think it over. " * 10, "chosen": "2", "rejected": "3"}] * 4
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = reward_context(
        tmp_path,
        tiny_model,
        data={"dataset": str(data)},
        eval_fraction=0,
        train={"max_steps": 1, "per_device_train_batch_size": 8, "max_length": 48},
    )
    with caplog.at_level(logging.INFO, logger="alignment"):
        trainer, counts = reward.build_trainer(ctx)
    assert counts["pairs_dropped_too_long"] == 4 and counts["pairs_train"] == 20 == len(trainer.train_dataset)
    assert any(r.levelno == logging.WARNING and "dropped 4 of 24 pairs (17%)" in r.getMessage() for r in caplog.records)


def test_on_policy_pairs_with_the_data_pairs_train_on_both_and_count_them(tmp_path, early_sft_checkpoint):
    """`on_policy.with_data_pairs`: the policy's graded samples and the data's own (correct, plausible mistake)
    pairs in one training set, each counted; without it, only the on-policy pairs."""
    from alignment.stages import reward

    on_policy = {**NEAR_ANSWER, "n": 6, "temperature": 1.0, "max_new_tokens": 6}
    data = {"task": "arithmetic", "split": "train", "n": 24}
    trainer, counts = reward.build_trainer(
        reward_context(tmp_path / "a", early_sft_checkpoint, data=data, on_policy=on_policy, eval_fraction=0)
    )
    assert 0 < counts["pairs_built"] <= 24 and "data_pairs" not in counts
    assert counts["pairs_train"] == counts["pairs_built"] == len(trainer.train_dataset)
    both = {**on_policy, "with_data_pairs": True}
    ctx = reward_context(tmp_path / "b", early_sft_checkpoint, data=data, on_policy=both, eval_fraction=0)
    trainer, counts = reward.build_trainer(ctx)
    assert counts["data_pairs"] == 24 and counts["pairs_built"] > 0
    assert counts["pairs_train"] == counts["pairs_built"] + 24 == len(trainer.train_dataset)
    assert "and the data's own 24 chosen/rejected pairs" in ctx.data_formats["data"]["format"]
