"""`rsft` stage: rejection sampling + SFT, by verifiers or a reward model, over rounds.

Fast: the selection rule, config validation, a reward-model-scored round on a tiny model, resume at
round granularity, the shipped code-rsft recipe (schema, SFT config, verifier). Slow: RSFT from the
SFT fixture raises held-out accuracy.

    python -m pytest tests/test_rsft.py -q -x
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import (
    REPO,
    heldout_accuracy,
    recipe_dict,
    require_isolation,
    run,
    write_recipe,
)

from alignment.errors import UserError
from alignment.tasks.arithmetic import verify

FAST = {
    "data": {"task": "arithmetic", "split": "train", "n": 16},
    "verifiers": ["arithmetic"],
    "sampling": {"n": 4, "max_new_tokens": 6, "temperature": 1.0},
    "select": "threshold",
    "threshold": 0.0,  # keep every parsed sample: a random-init model is rarely right
    "train": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 64, "learning_rate": 1.0e-3},
}


def candidate(text, score, passed=True, parsed=True, finished=True):
    return {"completion": text, "score": score, "passed": passed, "parsed": parsed, "finished": finished}


# ---------------------------------------------------------------------------------------------------
# Selection and config


def test_selection_rules():
    from alignment.stages.rsft import select_samples

    group = [
        candidate("12", 0.0, passed=False),
        candidate("13", 1.0),
        candidate(" 13", 1.0),  # duplicate
        candidate("14", 1.0, finished=False),
        candidate("", 1.0),
        candidate("15", 0.5, passed=False),
    ]
    texts = lambda kept: [c["completion"] for c in kept]
    assert texts(select_samples(group, "best_of_n", 1, None, by_verifier=True)) == ["13"]
    assert texts(select_samples(group, "threshold", 1, None, by_verifier=True)) == ["13"]  # passing ones only
    assert texts(select_samples(group, "top_k", 2, 0.5, by_verifier=True)) == ["13", "15"]
    assert texts(select_samples(group, "threshold", 1, 0.0, by_verifier=True)) == ["13", "15", "12"]
    assert select_samples([candidate("x", 1.0, passed=False)], "best_of_n", 1, None, by_verifier=True) == []
    rm = [candidate("a", -2.0), candidate("b", 3.0), candidate("c", 1.0)]  # reward-model scores
    assert texts(select_samples(rm, "best_of_n", 1, None, by_verifier=False)) == ["b"]
    assert texts(select_samples(rm, "top_k", 2, None, by_verifier=False)) == ["b", "c"]
    assert texts(select_samples(rm, "threshold", 1, 0.5, by_verifier=False)) == ["b", "c"]
    unparsed = [candidate("y", 2.0, parsed=False)]
    assert select_samples(unparsed, "threshold", 1, 1.0, by_verifier=True) == []


def test_regularized_best_of_n_ranks_by_score_plus_kl_coef_times_logprob():
    """score + kl_coef * log p: b (3 - 0.5 * 8 = -1) loses to c (1 - 0.5 * 2 = 0) and a (-2 - 0.5 * 1 = -2.5)
    stays last; at kl_coef 0 the score alone ranks, and the threshold still reads the score."""
    from alignment.stages.rsft import select_samples

    group = [
        {**candidate(t, score), "logprob": lp}
        for t, score, lp in [("a", -2.0, -1.0), ("b", 3.0, -8.0), ("c", 1.0, -2.0)]
    ]
    texts = lambda kept: [c["completion"] for c in kept]
    assert texts(select_samples(group, "top_k", 3, None, by_verifier=False, kl_coef=0.5)) == ["c", "b", "a"]
    assert texts(select_samples(group, "best_of_n", 1, None, by_verifier=False)) == ["b"]
    assert texts(select_samples(group, "top_k", 2, 0.0, by_verifier=False, kl_coef=0.5)) == ["c", "b"]


def test_kl_coef_log_probs_are_the_samplers_at_temperature_1_and_a_re_score_otherwise(early_sft_checkpoint):
    """The sampler's own log-probs (engine: loop) and a forward pass give the same log p(y|x) at temperature 1;
    at another temperature the sampler's are tempered, so the stage re-scores."""
    import dataclasses

    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import render_prompt
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import generate
    from alignment.stages.rsft import sample_logprobs

    model, tokenizer = load_policy(str(early_sft_checkpoint)), load_tokenizer(str(early_sft_checkpoint))
    prompts = ["What is 12+7?", "What is 48+37?"]
    for temperature in (1.0, 0.5):
        samples = generate(
            model,
            tokenizer,
            [render_prompt(tokenizer, p) for p in prompts],
            SamplingSpec(n=3, temperature=temperature, max_new_tokens=6),
        )
        assert all(s.logprobs is not None for s in samples)
        bare = [dataclasses.replace(s, logprobs=None) for s in samples]
        rescored = sample_logprobs(model, tokenizer, prompts, bare, 4, temperature)
        assert sample_logprobs(model, tokenizer, prompts, samples, 4, temperature) == pytest.approx(rescored, abs=1e-4)


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"verifiers": []}, "exactly one of 'verifiers'"),
        ({"reward_model": "x"}, "exactly one of 'verifiers'"),
        ({"verifiers": [], "reward_model": "x", "select": "threshold", "threshold": None}, "needs 'threshold'"),
        ({"select": "best_of_n", "k": 3}, "top_k"),
        ({"rounds": 0}, "rounds"),
        ({"sampling": {"n": 4, "temprature": 1.0}}, "temperature"),
        ({"eval_data": {"task": "arithmetic", "split": "test", "n": 4}}, "'eval_data' is not used by rsft"),
        ({"kl_coef": 0.1, "select": "threshold", "threshold": 0.0}, "'kl_coef' ranks candidates"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"verifiers": [], "reward_model": "x", "max_pass_rate": 0.5}, "'max_pass_rate' needs verifiers"),
        ({"max_pass_rate": 1.0}, "max_pass_rate"),
    ],
)
def test_config_errors(tmp_path, stage, message):
    from alignment.config.recipe import load_recipe

    with pytest.raises(UserError, match=message):
        load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rsft", {**FAST, **stage})))


def test_shipped_code_rsft_recipe_validates():
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import rsft
    from alignment.training.rewards import resolve_all

    recipe = load_recipe(REPO / "recipes" / "qwen2.5-0.5b" / "code-rsft.yaml")
    ctx = make_context(recipe, "rsft")
    assert ctx.config.verifiers[0].name == "python_tests"
    assert not ctx.config.verifiers[0].options.get("allow_unsandboxed")  # never ship an unsandboxed recipe
    args = rsft.sft_args(ctx, ctx.work_dir)
    assert args.completion_only_loss and args.learning_rate == 1.0e-4
    require_isolation()  # without it python_tests refuses to resolve, as designed
    resolve_all(ctx.config.verifiers, [recipe.base_dir], ctx.where)


# ---------------------------------------------------------------------------------------------------
# Short runs (the SFT fixture, so that samples end with the end-of-turn token and some are right)


def test_round_writes_selected_data_and_metrics(tmp_path, early_sft_checkpoint):
    recipe, result, _ = run(
        tmp_path, "rsft", {**FAST, "model": str(early_sft_checkpoint), "rounds": 2, "lora": {"r": 4, "lora_alpha": 8}}
    )
    out = recipe.stage_dir("rsft")
    metrics = result["metrics"]
    for k in (1, 2):
        rows = [json.loads(line) for line in (out / f"selected_round{k}.jsonl").read_text().splitlines()]
        assert len(rows) == metrics[f"round{k}/selected"] > 0
        assert {"prompt", "completion", "score", "round"} <= set(rows[0])
        assert 0 < metrics[f"round{k}/acceptance_rate"] <= 1 and f"round{k}/mean_score" in metrics
    assert (out / "model.safetensors").exists() and not (out / "adapter").exists()  # 2 rounds: merged only
    history = json.loads((out / "log_history.json").read_text())
    assert [h["round"] for h in history if "rsft/acceptance_rate" in h] == [1, 2]


def test_max_pass_rate_leaves_prompts_the_policy_mostly_solves_out_of_the_round(tmp_path, early_sft_checkpoint):
    """The same samples (same seed) with and without `max_pass_rate`: the filtered round keeps the plain round's
    rows except those of prompts passing in more than half their samples, and counts them."""
    near = [{"name": "numeric", "options": {"tolerance": 0.1}}]  # the fixture passes some of a prompt's samples
    stage = {**FAST, "model": str(early_sft_checkpoint), "verifiers": near, "select": "best_of_n", "threshold": None}
    stage["data"] = {**FAST["data"], "n": 32}
    rows = {}
    for name, extra in [("plain", {}), ("filtered", {"max_pass_rate": 0.5})]:
        recipe, result, _ = run(tmp_path / name, "rsft", {**stage, **extra})
        rows[name] = (recipe.stage_dir("rsft") / "selected_round1.jsonl").read_text().splitlines()
    skipped = result["metrics"]["round1/solved_skipped"]
    assert 0 < skipped < len(rows["plain"])  # the fixture solves some prompts most of the time, not all
    assert set(rows["filtered"]) <= set(rows["plain"]) and len(rows["filtered"]) == len(rows["plain"]) - skipped


def test_gold_is_scored_on_every_sample_and_never_selects(tmp_path):
    """`gold:` scores every sample of a round (`gold/<name>` in the log history, `round<k>/gold/<name>` in the
    metrics) and the kept ones (`selected_gold/<name>`), and takes no part in the selection: with a gold verifier
    of weight 1e6 the same rows are kept."""
    kept = {}
    for name, stage in [("plain", {}), ("gold", {"gold": [{"name": "numeric", "weight": 1.0e6}, "arithmetic"]})]:
        recipe, result, _ = run(tmp_path / name, "rsft", {**FAST, **stage})
        kept[name] = (recipe.stage_dir("rsft") / "selected_round1.jsonl").read_text()
        history = json.loads((recipe.stage_dir("rsft") / "log_history.json").read_text())
    rounds = [h for h in history if "rsft/acceptance_rate" in h]
    assert kept["gold"] == kept["plain"] and kept["plain"]
    assert rounds and 0.0 <= rounds[0]["gold/arithmetic"] <= 1.0 and "gold/numeric" in rounds[0]
    assert "round1/gold/arithmetic" in result["metrics"]
    # selected_gold: the gold verifier's mean over the kept samples alone, computed here by hand
    rows = [json.loads(line) for line in kept["gold"].splitlines()]
    right = [verify(r["completion"], str(eval(re.search(r"\d+[-+*]\d+", r["prompt"]).group()))) for r in rows]
    assert rounds[0]["selected_gold/arithmetic"] == pytest.approx(sum(right) / len(rows))
    assert result["metrics"]["round1/selected_gold/arithmetic"] == rounds[0]["selected_gold/arithmetic"]


def test_resume_continues_with_the_next_round(tmp_path, monkeypatch, early_sft_checkpoint):
    from alignment.stages import rsft

    calls = []
    original_sample, original_train = rsft.sample_and_select, rsft.train_round

    def sample(ctx, k, *args):
        calls.append(k)
        return original_sample(ctx, k, *args)

    def train_crashing_in_round_2(ctx, k, *args):
        if k == 2:
            raise RuntimeError("simulated crash in round 2")
        return original_train(ctx, k, *args)

    monkeypatch.setattr(rsft, "sample_and_select", sample)
    monkeypatch.setattr(rsft, "train_round", train_crashing_in_round_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path, "rsft", {**FAST, "model": str(early_sft_checkpoint), "rounds": 2})
    assert calls == [1, 2]
    monkeypatch.setattr(rsft, "train_round", original_train)
    recipe, result, _ = run(tmp_path, "rsft", {**FAST, "model": str(early_sft_checkpoint), "rounds": 2})
    assert calls == [1, 2]  # round 1 was not redone; round 2 reused its samples
    assert result["metrics"]["rounds"] == 2
    assert (recipe.stage_dir("rsft") / "selected_round1.jsonl").exists()


def test_reward_model_scoring(tmp_path, tiny_model, early_sft_checkpoint):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm_dir = tmp_path / "rm"
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    rm.config.pad_token_id = rm.config.pad_token_id or 0
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(rm_dir)
    stage = {
        "model": str(early_sft_checkpoint),
        "verifiers": [],
        "reward_model": str(rm_dir),
        "select": "top_k",
        "k": 2,
        "threshold": None,
        "kl_coef": 0.1,
    }
    recipe, result, _ = run(tmp_path / "run", "rsft", {**FAST, **stage})
    rows = [json.loads(line) for line in (recipe.stage_dir("rsft") / "selected_round1.jsonl").read_text().splitlines()]
    assert rows and all(isinstance(r["score"], float) for r in rows)
    assert all(r["logprob"] < 0 for r in rows)  # kl_coef: each kept sample's log-prob under the sampling policy
    per_prompt = {}
    for r in rows:
        per_prompt.setdefault(r["prompt"], []).append(r)
    assert max(len(v) for v in per_prompt.values()) <= 2
    assert "round1/pass_rate" not in result["metrics"]


# ---------------------------------------------------------------------------------------------------
# Accuracy from the SFT fixture


@pytest.mark.slow
def test_rsft_raises_heldout_accuracy(tmp_path, sft_checkpoint):
    stage = {"model": str(sft_checkpoint), "lora": None, **RSFT_ARITHMETIC}
    before = heldout_accuracy(sft_checkpoint)
    recipe, result, _ = run(tmp_path, "rsft", {**FAST, **stage})
    after = heldout_accuracy(recipe.stage_dir("rsft"))
    assert after >= before + MIN_GAIN


# Measured from the SFT fixture (2 heavily shared cores; held-out greedy accuracy, n=200): this config
# 0.57 -> 0.745 (round pass rates 0.235 -> 0.352); one round only: 0.645; n=1000 prompts, one round: 0.53.
# What matters is how many correct 2-digit answers the SFT steps see (the fixture gets those ~10% right).
RSFT_ARITHMETIC = {
    "data": {"task": "arithmetic", "split": "train", "n": 2000},
    "rounds": 2,
    "select": "best_of_n",
    "threshold": None,
    "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 8, "batch_size": 256},
    "train": {
        "learning_rate": 5.0e-4,
        "num_train_epochs": 2,
        "per_device_train_batch_size": 16,
        "max_length": 64,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 10,
        "logging_steps": 50,
    },
}
MIN_GAIN = 0.10


def test_selected_rows_longer_than_max_length_are_counted_and_said(tmp_path, logged):
    """The selected samples are trained by SFT, which cuts rows at max_length: each round counts them
    (rows_truncated, per round and in all, in stage.json) and says so, as the sft stage does."""
    from alignment.data.formatting import render_pair
    from alignment.models.tokenizer import load_tokenizer
    from alignment.training.rows import token_rows

    (tmp_path / "accept.py").write_text("def everything(completion):\n    return 1.0\n")
    stage = {
        "verifiers": ["accept:everything"],
        "sampling": {"n": 4, "max_new_tokens": 40, "temperature": 1.0},
        "train": {**FAST["train"], "max_length": 32},
    }
    recipe, result, _ = run(tmp_path, "rsft", {**FAST, **stage})
    out = recipe.stage_dir("rsft")
    tokenizer = load_tokenizer(str(out))
    selected = [json.loads(line) for line in (out / "selected_round1.jsonl").read_text().splitlines()]
    longer = sum(len(r["input_ids"]) > 32 for r in token_rows(tokenizer, [render_pair(tokenizer, s) for s in selected]))
    assert longer > 0
    stage_json = json.loads((out / "stage.json").read_text())
    assert result["metrics"]["round1/rows_truncated"] == stage_json["metrics"]["rows_truncated"] == longer
    said = logged()
    assert f"round 1] {longer} of {len(selected)} rows" in said and "longer than max_length=32" in said
