"""SFT stage end to end, the runner's skip/force behaviour, LoRA chaining and the distributed path."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    QUICK_TRAIN,
    REPO,
    heldout_accuracy,
    sft_recipe,
    write_recipe,
)

from alignment.config.recipe import load_recipe
from alignment.run.runner import run_recipe


def params(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_sft_trains_writes_checkpoint_and_rerun_skips(tmp_path, caplog):
    path = write_recipe(tmp_path, sft_recipe(tmp_path))
    recipe = load_recipe(path)
    run_recipe(recipe)
    out = recipe.stage_dir("sft")
    record = json.loads((out / "stage.json").read_text())
    assert record["kind"] == "sft" and record["metrics"]["train_loss"] > 0
    assert 0 < record["cpu_time_s"] and record["peak_rss_mib"] > 100  # torch alone keeps more than 100 MiB resident
    assert {"torch", "transformers", "trl"} <= set(record["versions"])
    assert (out / "tokenizer.json").exists() and (out / "README.md").exists()
    before, base = params(out), params(recipe.out / "base")
    assert any(not torch.equal(before[k], base[k]) for k in before), "SFT did not change any weight"

    finished = written(out)
    with caplog.at_level(logging.INFO, logger="alignment"):
        run_recipe(load_recipe(path))
    assert any("skipping" in m for m in caplog.messages)
    assert written(out) == finished, "a rerun rewrote a finished stage"
    run_recipe(load_recipe(path), force=True)
    rewritten = written(out)
    for name in ("stage.json", "model.safetensors"):
        assert rewritten[name][1] != finished[name][1], f"--force did not rewrite {name}"
    assert not (recipe.out / ".staging" / "sft").exists() and not (recipe.out / "sft.old").exists()


def written(folder) -> dict[str, tuple[bytes, int]]:
    """(bytes, mtime in ns) of a stage's stage.json and weights: what a rerun must leave alone."""
    return {
        name: ((folder / name).read_bytes(), (folder / name).stat().st_mtime_ns)
        for name in ("stage.json", "model.safetensors")
    }


def test_sft_on_chat_messages_with_lora_keeps_adapter(tmp_path):
    recipe = sft_recipe(tmp_path, lora={"r": 4, "lora_alpha": 8})
    recipe["stages"]["sft"]["data"]["format"] = "messages"
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    run_recipe(loaded)
    out = loaded.stage_dir("sft")
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "config.json").exists(), "merged weights are saved beside the adapter"


def test_packed_padding_free_sft_trains_on_fewer_longer_rows(tmp_path):
    """TRL's packing (`packing: true, packing_strategy: bfd`, padding-free) passes through `train:`: the
    600 short rows are packed into far fewer 64-token rows, so one epoch takes fewer optimizer steps, and
    the weights still move. (Opt-in: see docs/performance.md for why it is not the default.)"""
    steps = {}
    for packed in (False, True):
        recipe = sft_recipe(tmp_path / str(packed))
        if packed:
            recipe["stages"]["sft"]["train"] = {
                **QUICK_TRAIN,
                "packing": True,
                "packing_strategy": "bfd",
                "per_device_train_batch_size": 4,
            }
        loaded = load_recipe(write_recipe(tmp_path / str(packed), recipe))
        run_recipe(loaded)
        record = json.loads((loaded.stage_dir("sft") / "stage.json").read_text())
        steps[packed] = json.loads((loaded.stage_dir("sft") / "log_history.json").read_text())[-1]["step"]
        assert record["metrics"]["train_loss"] > 0
        trained, base = params(loaded.stage_dir("sft")), params(loaded.out / "base")
        assert any(not torch.equal(trained[k], base[k]) for k in trained)
    assert steps[False] == 19  # ceil(600 / 32)
    assert steps[True] * 4 <= 600 / 2  # measured 50 steps: 600 rows of ~20 tokens fill about 200 rows of 64


@pytest.mark.slow
def test_sft_model_beats_the_from_scratch_model(sft_checkpoint):
    trained = heldout_accuracy(sft_checkpoint)
    scratch = heldout_accuracy(sft_checkpoint.parent / "base")
    assert scratch < 0.05 and trained > scratch + 0.3


def test_lora_chain_reference_reproduces_previous_stage(tmp_path):
    """sft -> sft2 with LoRA: sft2's reference (its adapter disabled) is exactly the sft policy."""
    from alignment.config.model import LoraSpec
    from alignment.models.loading import load_policy
    from alignment.models.lora import apply_lora

    recipe = sft_recipe(tmp_path, lora={"r": 4, "lora_alpha": 8})
    recipe["stages"]["sft2"] = {
        "kind": "sft",
        "model": "${sft}",
        "data": {"task": "arithmetic", "n": 200},
        "train": QUICK_TRAIN,
    }
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    run_recipe(loaded)
    first = load_policy(str(loaded.stage_dir("sft"))).eval()
    second = apply_lora(load_policy(str(loaded.stage_dir("sft"))), LoraSpec(r=4, lora_alpha=8))
    # Give the fresh adapter non-zero weights so that "disabled" is a real difference.
    for name, p in second.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.tensor([[4, 30, 40, 50, 2, 5]])
    with torch.no_grad():
        expected = first(ids).logits
        with second.disable_adapter():
            reference = second(ids).logits
        adapted = second(ids).logits
    assert torch.allclose(reference, expected, atol=1e-5)
    assert not torch.allclose(adapted, expected, atol=1e-3)


def test_prompt_rendering_is_one_convention(tiny_model):
    """SFT text, RL prompts and reward-model text share the same rendering; no trailing newline."""
    from alignment.data.formatting import (
        end_of_turn,
        render_completion,
        render_pair,
        render_prompt,
    )
    from alignment.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    pair = render_pair(tokenizer, {"prompt": "What is 1+2?", "completion": "3"})
    assert pair["prompt"] == render_prompt(tokenizer, "What is 1+2?") == "<|user|>What is 1+2?<|end|><|assistant|>"
    assert pair["completion"] == "3<|end|>" == render_completion(tokenizer, "What is 1+2?", "3")
    chat = render_pair(
        tokenizer, {"messages": [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"}]}
    )
    assert chat == pair
    ultrachat = {
        "prompt": "What is 1+2?",
        "prompt_id": "x1",
        "messages": [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"}],
    }
    assert render_pair(tokenizer, ultrachat) == pair  # prompt + messages, no completion: the conversation
    assert end_of_turn(tokenizer) == "<|end|>"


def test_render_completion_cuts_trailing_newline_after_end_of_turn(tiny_model):
    from alignment.data.formatting import render_completion
    from alignment.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    tokenizer.chat_template = tokenizer.chat_template.replace("<|end|>{% endfor %}", "<|end|>\n{% endfor %}")
    assert render_completion(tokenizer, "q", "42") == "42<|end|>"


@pytest.mark.slow
def test_sft_under_accelerate_two_cpu_processes_only_rank0_writes(tmp_path):
    path = write_recipe(tmp_path, sft_recipe(tmp_path))
    env = {**os.environ, "ALIGN_NO_PROGRESS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "configs/accelerate/cpu_2proc.yaml"),
            "--main_process_port",
            "29533",
            str(REPO / "scripts/run_recipe.py"),
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "sft" / "stage.json").exists()
    assert result.stdout.count("[sft] done") == 1, "only rank 0 logs"
    assert sorted(p.name for p in out.iterdir()) == ["base", "sft"]


def test_answers_end_with_one_end_of_turn_token(tmp_path, tiny_model):
    """When EOS differs from the template's end-of-turn token (Qwen2.5 base: <|endoftext|> vs <|im_end|>),
    TRL must not append EOS after the rendered end-of-turn token; the saved tokenizer keeps its own EOS."""
    import shutil

    from transformers import AutoTokenizer

    from alignment.run.runner import make_context
    from alignment.stages import sft

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = "<|system|>"  # <|end|> stays the special token closing each turn, like <|im_end|>
    tokenizer.save_pretrained(folder)
    recipe = {
        "name": "eos",
        "model": str(folder),
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "stages": {"sft": {"data": {"task": "arithmetic", "n": 8}, "train": {"max_steps": 1, "max_length": 64}}},
    }
    trainer, tokenizer, _ = sft.build_trainer(make_context(load_recipe(write_recipe(tmp_path, recipe)), "sft"))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert tokenizer.eos_token == "<|system|>"
    for row in trainer.train_dataset:
        answer = [t for t in row["labels"] if t != -100]  # the completion-only loss trains on these
        assert answer[-1] == end and end not in answer[:-1] and tokenizer.eos_token_id not in answer


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_trains_on_trls_conversational_prompt_completion_rows(tmp_path):
    from alignment.data.formatting import render_pair
    from alignment.models.tokenizer import load_tokenizer

    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a}+{a}?"}],
            "completion": [{"role": "assistant", "content": str(2 * a)}],
        }
        for a in range(40)
    ]
    recipe = sft_recipe(tmp_path)
    recipe["stages"]["sft"]["data"] = {"dataset": jsonl(tmp_path / "chat.jsonl", rows)}
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    record = run_recipe(loaded)["sft"]
    assert record["metrics"]["rows"] == 40 and record["metrics"]["rows_truncated"] == 0
    tokenizer = load_tokenizer(str(loaded.stage_dir("sft")))
    plain = render_pair(tokenizer, {"prompt": rows[3]["prompt"], "completion": "6"})
    assert render_pair(tokenizer, rows[3]) == plain  # the same text as a string completion


def test_a_conversational_completion_must_be_one_assistant_message():
    from alignment.data.formatting import prompt_and_completion
    from alignment.errors import UserError

    with pytest.raises(UserError, match=r"row 7.*one assistant message.*\['user'\]"):
        prompt_and_completion({"prompt": "q", "completion": [{"role": "user", "content": "x"}]}, 7)


def test_sft_on_plain_text_rows_and_truncated_rows_are_counted_and_said(tmp_path, caplog):
    rows = [{"text": f"{a} plus {a} makes {2 * a}." + (" and so on" * 20 if a % 4 == 0 else "")} for a in range(40)]
    recipe = sft_recipe(tmp_path)
    recipe["stages"]["sft"]["data"] = {"dataset": jsonl(tmp_path / "text.jsonl", rows)}
    recipe["stages"]["sft"]["train"] = {**QUICK_TRAIN, "max_length": 64}
    with caplog.at_level(logging.INFO, logger="alignment"):
        record = run_recipe(load_recipe(write_recipe(tmp_path, recipe)))["sft"]
    assert record["metrics"]["rows"] == 40 and record["metrics"]["rows_truncated"] == 10
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "10 of 40 rows (25%)" in r.getMessage()]
    assert warned and "max_length=64" in warned[0].getMessage()
    assert record["metrics"]["train_loss"] > 0


def test_the_recipes_template_settings_are_trained_with_and_saved(tmp_path):
    from alignment.data.formatting import render_prompt
    from alignment.models.tokenizer import load_tokenizer

    recipe = sft_recipe(tmp_path, template={"system_prompt": "Be brief."})
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    run_recipe(loaded)
    saved = load_tokenizer(str(loaded.stage_dir("sft")))
    assert render_prompt(saved, "What is 1+1?").startswith("<|system|>Be brief.<|end|>")


@pytest.mark.parametrize("save_dtype, expected", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_outputs_are_saved_in_the_start_checkpoints_dtype_unless_the_recipe_says(
    tmp_path, tiny_model, save_dtype, expected
):
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    bf16 = tmp_path / "bf16"
    load_policy(str(tiny_model), dtype=torch.bfloat16).save_pretrained(bf16)
    load_tokenizer(str(tiny_model)).save_pretrained(bf16)
    recipe = sft_recipe(tmp_path, model=str(bf16), save_dtype=save_dtype, lora={"r": 4, "lora_alpha": 8})
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    run_recipe(loaded)
    weights, start = params(loaded.stage_dir("sft")), params(bf16)
    assert {t.dtype for t in weights.values()} == {expected}
    assert any(not torch.equal(weights[k].to(torch.float32), start[k].to(torch.float32)) for k in start)  # trained


def test_data_errors_name_the_row_of_the_file_not_of_the_shuffled_order(tmp_path):
    from alignment.errors import UserError
    from alignment.run.runner import check_recipe

    rows = [{"prompt": f"What is {a}+1?", "completion": f"it is {a + 1}"} for a in range(30)]
    rows[17]["completion"] = 18  # not a string
    recipe = sft_recipe(tmp_path)
    recipe["stages"]["sft"]["data"] = {"dataset": jsonl(tmp_path / "d.jsonl", rows)}  # shuffled by default
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    with pytest.raises(UserError, match=r"line 18 of \S*d.jsonl, column 'completion' is int"):
        check_recipe(loaded)
    rows[17]["completion"] = "it is 18"
    rows[23] = {"prompt": "q", "completion": [{"role": "user", "content": "x"}]}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"\(line 24 of \S*d.jsonl\).*one assistant message"):
        check_recipe(loaded)
