"""Reliability: resume after a crash, the non-finite guard, atomic outputs and secret hygiene."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALLEST_MODEL, sft_recipe, write_recipe
from helpers import tiny_ppo_recipe
from transformers import TrainerCallback

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.run.runner import run_recipe
from alignment.training.trainer import NonFiniteError

TRAIN = {
    "num_train_epochs": 1,
    "per_device_train_batch_size": 16,
    "learning_rate": 3e-3,
    "max_length": 64,
    "save_steps": 5,
    "logging_steps": 1,
}


# The sft stage these tests run: the smallest model, checkpoints every 5 steps (see sft_recipe).
SFT = {"n": 200, "train": TRAIN, "model": SMALLEST_MODEL, "seed": 5}


class RaiseAt(TrainerCallback):
    """Raises `error` once training reaches `step` (after the checkpoint before it): a kill by default."""

    def __init__(self, step: int, error: BaseException | None = None):
        self.step = step
        self.error = error or KeyboardInterrupt(f"simulated crash at step {step}")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise self.error


class StepRecorder(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(state.global_step)


class PoisonGradients(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))


def with_extra_callback(monkeypatch, callback):
    """Run `callback` before the stage's own callbacks (the guard) in every TRL stage."""
    from helpers import patch_everywhere

    import alignment.stages.dpo  # noqa: F401 (bind their imports)
    import alignment.training.trainer as utils

    real = utils.trainer_callbacks
    patch_everywhere(monkeypatch, utils, "trainer_callbacks", lambda ctx: [callback, *real(ctx)])


def final_weights(recipe, stage="sft") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(recipe.stage_dir(stage) / "model.safetensors"))


def test_resumed_sft_matches_uninterrupted_run(tmp_path, monkeypatch):
    straight = load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, "straight", **SFT), "a.yaml"))
    run_recipe(straight)

    resumed = load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, "resumed", **SFT), "b.yaml"))
    with monkeypatch.context() as patch:
        with_extra_callback(patch, RaiseAt(8))
        with pytest.raises(KeyboardInterrupt):
            run_recipe(resumed)
    assert not resumed.stage_dir("sft").exists(), "a crashed stage must not look finished"
    checkpoints = sorted((resumed.out / ".work" / "sft" / "trainer").glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-5"]
    steps = StepRecorder()
    with monkeypatch.context() as patch:
        with_extra_callback(patch, steps)
        run_recipe(resumed)
    assert steps.seen[0] == 6, f"resumed from step 5, not from zero (first step run: {steps.seen[0]})"
    a, b = final_weights(straight), final_weights(resumed)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def dpo_recipe(tmp_path, name, lora):
    return {
        "name": name,
        "model": SMALLEST_MODEL,
        "output_dir": str(tmp_path / name),
        "seed": 5,
        "lora": {"r": 4, "lora_alpha": 8} if lora else None,
        "stages": {
            "dpo": {"data": {"task": "arithmetic", "n": 200}, "train": {**TRAIN, "beta": 0.1, "learning_rate": 1e-3}}
        },
    }


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resumed_dpo_matches_uninterrupted_run(tmp_path, monkeypatch, lora):
    """The reference (adapter disabled, or the frozen in-memory copy) and the data order survive the
    restart, so the resumed run ends with the uninterrupted run's weights."""
    straight = load_recipe(write_recipe(tmp_path, dpo_recipe(tmp_path, "straight", lora), "a.yaml"))
    run_recipe(straight)

    resumed = load_recipe(write_recipe(tmp_path, dpo_recipe(tmp_path, "resumed", lora), "b.yaml"))
    with monkeypatch.context() as patch:
        with_extra_callback(patch, RaiseAt(8))
        with pytest.raises(KeyboardInterrupt):
            run_recipe(resumed)
    assert not resumed.stage_dir("dpo").exists(), "a crashed stage must not look finished"
    steps = StepRecorder()
    with monkeypatch.context() as patch:
        with_extra_callback(patch, steps)
        run_recipe(resumed)
    assert steps.seen[0] == 6, f"resumed from step 5, not from zero (first step run: {steps.seen[0]})"
    a, b = final_weights(straight, "dpo"), final_weights(resumed, "dpo")
    base = final_weights(straight, "base")
    assert any(not a[k].equal(base[k]) for k in a), "DPO changed the weights"
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_nonfinite_gradient_stops_before_the_optimizer_step(tmp_path, monkeypatch):
    recipe = load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, **SFT)))
    with_extra_callback(monkeypatch, PoisonGradients(7))
    with pytest.raises(NonFiniteError, match=r"stage 'sft': non-finite gradient norm \(nan\) at step 7"):
        run_recipe(recipe)
    assert not recipe.stage_dir("sft").exists()
    checkpoint = recipe.out / ".work" / "sft" / "trainer" / "checkpoint-5"
    assert (checkpoint / "model.safetensors").exists(), "the last good checkpoint is intact"
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(str(checkpoint / "model.safetensors")).values())


def test_disk_full_while_saving_is_a_clear_error_and_keeps_earlier_stages(tmp_path, monkeypatch):
    import errno

    spec = sft_recipe(tmp_path, **SFT)
    spec["stages"]["sft2"] = {"kind": "sft", "data": {"task": "arithmetic", "n": 50}, "train": TRAIN}
    recipe = load_recipe(write_recipe(tmp_path, spec))
    run_recipe(recipe, only=["sft"])
    before = (recipe.stage_dir("sft") / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "model.safetensors")

    import alignment.training.sharding as sharding

    monkeypatch.setattr(sharding, "save_checkpoint", full_disk)  # every stage saves through sharding.save_trained
    with pytest.raises(
        UserError, match="stage 'sft2': could not write model.safetensors \\(No space left on device\\)"
    ):
        run_recipe(recipe, only=["sft2"])
    assert not recipe.stage_dir("sft2").exists()
    assert (recipe.stage_dir("sft") / "model.safetensors").read_bytes() == before


def test_out_of_memory_names_the_settings_that_shrink_the_stage_and_a_rerun_resumes(tmp_path, monkeypatch):
    recipe = load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, **SFT)))
    out_of_memory = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n(allocator details)")
    with monkeypatch.context() as patch:
        with_extra_callback(patch, RaiseAt(7, out_of_memory))
        with pytest.raises(
            UserError,
            match=r"(?s)stage 'sft' \(sft\) ran out of memory: CUDA out of memory\. Tried to "
            r"allocate 2\.00 GiB\. .*stages\.sft: `train\.gradient_checkpointing: true`.*"
            r"per_device_train_batch_size.*resumes from the last checkpoint",
        ) as caught:
            run_recipe(recipe)
    assert "allocator details" not in str(caught.value)  # the first line of the error, not the allocator dump
    assert not recipe.stage_dir("sft").exists()
    steps = StepRecorder()
    with monkeypatch.context() as patch:
        with_extra_callback(patch, steps)
        run_recipe(recipe)
    assert steps.seen[0] == 6  # the checkpoint at step 5 survived the error


def test_out_of_memory_in_ppo_names_ppo_settings(tmp_path, tiny_model, monkeypatch):

    from alignment.stages import ppo

    def out_of_memory(ctx):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(ppo, "run", out_of_memory)
    with pytest.raises(
        UserError,
        match=r"(?s)stage 'ppo' \(ppo\) ran out of memory.*`train\.mini_batch_size`.*"
        r"`rollout\.batch_size`.*LoRA",
    ):
        run_recipe(load_recipe(tiny_ppo_recipe(tmp_path, tiny_model)))


class SecretInLogs(TrainerCallback):
    """Puts `secret` into every trainer log entry, as a logging integration echoing its URL or config would."""

    def __init__(self, secret: str):
        self.secret = secret

    def on_log(self, args, state, control, logs=None, **kwargs):
        state.log_history[-1]["note"] = f"synced with {self.secret}"


def test_secrets_never_reach_stage_json_model_card_or_log_history(tmp_path, monkeypatch):
    secret = "hf_plantedSECRETvalue1234567"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("WANDB_API_KEY", "wandb-planted-secret-0987654321")
    with_extra_callback(monkeypatch, SecretInLogs(secret))
    spec = sft_recipe(tmp_path, **SFT)
    spec["stages"]["sft"]["train"] = {**TRAIN, "hub_token": secret, "run_name": f"run-{secret}"}
    recipe = load_recipe(write_recipe(tmp_path, spec))
    run_recipe(recipe)
    for name in ("stage.json", "README.md", "log_history.json"):
        text = (recipe.stage_dir("sft") / name).read_text()
        assert secret not in text and "wandb-planted-secret" not in text, name
    assert "***" in (recipe.stage_dir("sft") / "stage.json").read_text()
    history = json.loads((recipe.stage_dir("sft") / "log_history.json").read_text())
    assert history and all(entry["note"] == "synced with ***" for entry in history), history[:2]
    assert "loss" in history[0], "redaction must keep the metrics"


def test_trust_remote_code_is_off_unless_the_recipe_opts_in(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, **SFT)))
    assert recipe.trust_remote_code is False
    opted = load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, **SFT, trust_remote_code=True), "t.yaml"))
    assert opted.trust_remote_code is True


def test_runs_flush_denormal_floats_to_zero(tmp_path, monkeypatch):
    """Saturated reward-model gradients reach the denormal range, where CPU arithmetic crawls; a run turns
    flushing on before its first stage, and flushed arithmetic really does give zero."""
    import alignment.run.runner as runner

    class Called(Exception):
        pass

    def flush():
        raise Called

    monkeypatch.setattr(runner, "flush_denormals", flush)
    with pytest.raises(Called):
        run_recipe(load_recipe(write_recipe(tmp_path, sft_recipe(tmp_path, **SFT))))
    assert not (tmp_path / "out" / "sft").exists(), "flushing is set up before any stage runs"
    monkeypatch.undo()
    try:
        if runner.flush_denormals():
            assert (torch.tensor([1e-39]) * 1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)  # leave the test process as it was
