"""The gradient-checkpointing decision: its activation estimate against what autograd really saves, and
the stages turning checkpointing on exactly when the estimate says the GPU is too small."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL, recipe_dict, write_recipe
from helpers import patch_everywhere, tiny_ppo_recipe, trainable_digest

from alignment.training import memory
from alignment.training.memory import ModelShape, StepShape, peak_bytes, plan

QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def saved_activation_bytes(config, dtype, tokens: int, checkpointing: bool = False) -> int:
    """Bytes of distinct non-parameter tensors autograd keeps for backward in one forward pass."""
    from transformers import AutoModelForCausalLM

    from alignment.models.lora import enable_checkpointing

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    if checkpointing:
        enable_checkpointing(model, {"use_reentrant": False})
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(0, 100, (2, tokens // 2)), use_cache=False)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_layer_activation_estimate_matches_what_autograd_saves(arch, dtype):
    from transformers import LlamaConfig, Qwen2Config

    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    shape = dict(QWEN_05B, vocab_size=1000)  # the vocabulary only sizes the logits, not the layers
    one, three = (config_class(**shape, num_hidden_layers=n, attn_implementation="sdpa") for n in (1, 3))
    tokens = 256

    def per_layer_and_token(checkpointing: bool) -> float:  # 3 layers minus 1: what two layers add
        added = saved_activation_bytes(three, dtype, tokens, checkpointing) - saved_activation_bytes(
            one, dtype, tokens, checkpointing
        )
        return added / (2 * tokens)

    estimate = ModelShape.from_config(three).layer_activation_bytes(torch.finfo(dtype).bits // 8)
    assert estimate == pytest.approx(per_layer_and_token(False), rel=0.05)
    # with checkpointing a layer keeps about one hidden state per token (its input)
    assert per_layer_and_token(True) == pytest.approx(shape["hidden_size"] * torch.finfo(dtype).bits // 8, rel=0.1)


def test_parameter_count_is_exact_without_building_weights():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**dict(QWEN_05B, vocab_size=1000), num_hidden_layers=2)
    assert ModelShape.from_config(config).parameters == AutoModelForCausalLM.from_config(config).num_parameters()


def test_plan_turns_checkpointing_on_only_when_the_step_does_not_fit():
    from transformers import Qwen2Config

    qwen_05b = ModelShape.from_config(Qwen2Config(**QWEN_05B, num_hidden_layers=24))
    assert 490e6 < qwen_05b.parameters < 500e6  # Qwen2.5-0.5B has 494M
    sft = StepShape(sequences=8, length=1024)  # TRL's SFT defaults
    without = peak_bytes(qwen_05b, sft, 2, checkpointing=False)
    with_ = peak_bytes(qwen_05b, sft, 2, checkpointing=True)
    assert with_ < without
    h200 = int(139 * memory.GIB * memory.USABLE_FRACTION)
    assert not plan(qwen_05b, sft, 2, h200).checkpointing  # 0.5B full SFT fits an H200 either way
    small_gpu = (without + with_) // 2
    decision = plan(qwen_05b, sft, 2, small_gpu)
    assert decision.checkpointing and "gradient checkpointing on" in decision.describe()
    # LoRA needs no gradients or optimizer state for the base, and DPO's full-weight reference is a second copy
    assert peak_bytes(qwen_05b, StepShape(8, 1024, lora_rank=16), 2, False) < without
    dpo = peak_bytes(qwen_05b, StepShape(16, 1024, reference_copy=True), 2, False)
    assert dpo - peak_bytes(qwen_05b, StepShape(16, 1024), 2, False) == qwen_05b.parameters * 2


def stage_recipe(tmp_path, kind: str = "sft", **train) -> dict:
    """A LoRA recipe of one stage that trains two steps on the tiny model."""
    data = {"task": "arithmetic", "n": 64} if kind == "sft" else {"task": "arithmetic", "split": "train", "n": 16}
    return {
        "name": "gc",
        "model": TINY_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": {
            kind: {
                "kind": kind,
                "data": data,
                "train": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 64, **train},
            }
        },
    }


def enable_checkpointing_method() -> tuple[str, str]:
    """The model method and its keyword argument under this transformers' name (5.x renamed gradient to
    activation checkpointing)."""
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        return "activation_checkpointing_enable", "activation_checkpointing_kwargs"
    return "gradient_checkpointing_enable", "gradient_checkpointing_kwargs"


@pytest.fixture
def checkpointing_calls(monkeypatch):
    """Record every model on which the Trainer turns gradient checkpointing on."""
    from transformers import PreTrainedModel

    method, keyword = enable_checkpointing_method()
    calls = []
    original = getattr(PreTrainedModel, method)

    def recording(self, *args, **kwargs):
        calls.append(kwargs.get(keyword))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, method, recording)
    return calls


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_stage_turns_checkpointing_on_when_the_gpu_is_too_small(
    kind, tmp_path, monkeypatch, logged, checkpointing_calls
):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    monkeypatch.setattr(memory, "usable_gpu_bytes", lambda: 1_000_000)  # a 1 MB "GPU": nothing fits
    recipe = load_recipe(write_recipe(tmp_path, stage_recipe(tmp_path, kind)))
    run_recipe(recipe)
    printed = logged()
    assert f"[stages.{kind}.train] gradient checkpointing on: estimated peak" in printed
    # non-reentrant: LoRA's frozen inputs need no grads (TRL's DPO turns it on more than once)
    assert checkpointing_calls and all(call == {"use_reentrant": False} for call in checkpointing_calls)
    assert (recipe.stage_dir(kind) / "adapter").exists()


def test_stage_leaves_checkpointing_off_when_it_fits_or_the_recipe_says_so(
    tmp_path, monkeypatch, logged, checkpointing_calls
):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    monkeypatch.setattr(memory, "usable_gpu_bytes", lambda: 100 * memory.GIB)
    run_recipe(load_recipe(write_recipe(tmp_path / "fits", stage_recipe(tmp_path / "fits"))))
    assert "gradient checkpointing off" in logged()

    monkeypatch.setattr(memory, "usable_gpu_bytes", lambda: 1_000_000)
    explicit = stage_recipe(tmp_path / "explicit", gradient_checkpointing=False)
    run_recipe(load_recipe(write_recipe(tmp_path / "explicit", explicit)))
    assert "gradient checkpointing" not in logged()  # the recipe's setting is not second-guessed
    assert checkpointing_calls == []


def test_step_shape_reads_each_stage_kinds_config(tmp_path):
    from trl import DPOConfig, GRPOConfig, RewardConfig, SFTConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4)
    assert memory.step_shape("sft", SFTConfig(**common, max_length=512), None) == StepShape(4, 512)
    # chosen and rejected run in one batch; a full-weight reference is a second copy unless precomputed
    dpo = DPOConfig(**common, max_length=512)
    assert memory.step_shape("dpo", dpo, None) == StepShape(8, 512, reference_copy=True)
    assert memory.step_shape("dpo", dpo, 16) == StepShape(8, 512, lora_rank=16)
    assert memory.step_shape("reward", RewardConfig(**common, max_length=512), 16) == StepShape(
        8, 512, vocab_logits=False, lora_rank=16
    )
    grpo = GRPOConfig(**common, max_completion_length=256, num_generations=4, beta=0.04)
    assert memory.step_shape("rlvr", grpo, None) == StepShape(4, 512, reference_copy=True)


def test_no_decision_without_a_gpu_or_a_readable_model(tmp_path):
    from trl import SFTConfig

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    if not torch.cuda.is_available():
        assert memory.usable_gpu_bytes() is None
        assert not memory.needs_gradient_checkpointing(args, "sft", "no/such-model", None, False, "x")
    assert memory.model_shape(str(tmp_path / "not-written-yet"), False) is None


def test_an_unreadable_model_leaves_checkpointing_off_and_says_so(tmp_path, monkeypatch, logged):
    monkeypatch.setattr(memory, "usable_gpu_bytes", lambda: 1_000_000)
    step = StepShape(8, 1024)
    assert not memory.needs_checkpointing(str(tmp_path / "not-written-yet"), lambda: step, 2, False, "stages.sft.train")
    printed = logged()
    assert "[stages.sft.train] gradient checkpointing off: could not read the shape of" in printed
    assert "not-written-yet" in printed and "train.gradient_checkpointing: true" in printed


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_ppo_checkpointing_gives_the_exact_gradients_and_keeps_less(lora, tiny_model):
    """PPO's LoRA critic runs the policy's layers under another adapter, and backward recomputes them under
    the adapter active by then (the critic's gradients came out wrong before `context_fn`). PPO also keeps
    its models in eval mode: checkpointing must still happen, and (lora_dropout 0.5) without dropout."""
    from alignment.config.model import LoraSpec
    from alignment.training.actor_critic import build_models

    def run(checkpointing: bool):
        torch.manual_seed(0)
        actor_critic = build_models(
            str(tiny_model), LoraSpec(r=4, lora_alpha=8, lora_dropout=0.5) if lora else None
        ).actor_critic
        with torch.no_grad():  # adapters and value head away from their zero start, so every gradient shows
            for name, param in actor_critic.named_parameters():
                if "lora_B" in name or "value_head" in name:
                    param.normal_(0, 0.5)
        if checkpointing:
            actor_critic.enable_checkpointing()
        actor_critic.eval()
        ids = torch.randint(3, 90, (2, 12))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            logprobs, values, _ = actor_critic(ids, torch.ones_like(ids), 4)
        (logprobs.sum() + values.sum()).backward()
        return {n: p.grad for n, p in actor_critic.named_parameters() if p.grad is not None}, sum(saved)

    (exact, kept), (recomputed, kept_checkpointing) = run(False), run(True)
    assert exact.keys() == recomputed.keys() and any("critic" in n or "critic_backbone" in n for n in exact)
    for name in exact:
        assert torch.allclose(exact[name], recomputed[name], atol=1e-6), name
    assert kept_checkpointing < kept / 2


def test_ppo_stage_checkpoints_when_the_gpu_is_too_small_and_trains_the_same(tmp_path, tiny_model, monkeypatch, logged):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe
    from alignment.training import actor_critic

    # Attention calls of the first layer under autograd: forward passes, plus recomputations when checkpointed
    # (sampling in between calls eval() on the policy, which must not switch checkpointing off).
    calls = []
    build_models = actor_critic.build_models

    def counting_build_models(*args, **kwargs):
        models = build_models(*args, **kwargs)
        layer = actor_critic.backbone_of(models.policy.get_base_model()).layers[0]
        layer.self_attn.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        return models

    patch_everywhere(monkeypatch, actor_critic, "build_models", counting_build_models)
    runs = {}
    for name, available, train in (
        ("exact", 100 * memory.GIB, {}),
        ("checkpointed", 1_000_000, {}),
        ("off by recipe", 1_000_000, {"gradient_checkpointing": False}),
    ):
        monkeypatch.setattr(memory, "usable_gpu_bytes", lambda available=available: available)
        folder = tmp_path / name.replace(" ", "-")
        calls.clear()
        run_recipe(load_recipe(tiny_ppo_recipe(folder, tiny_model, train=train)))
        runs[name] = (
            logged(),
            trainable_digest(folder / "out" / "ppo" / "adapter" / "adapter_model.safetensors"),
            sum(calls),
        )
    assert "[stages.ppo.train] gradient checkpointing off" in runs["exact"][0]
    assert "[stages.ppo.train] gradient checkpointing on" in runs["checkpointed"][0]
    assert "gradient checkpointing" not in runs["off by recipe"][0]
    # 3 updates x 4 micro-batches (8 rows, minibatches of 4 in 2 steps) x (policy + critic pass), and as many
    # recomputations when checkpointed
    assert runs["exact"][2] == runs["off by recipe"][2] == 24 and runs["checkpointed"][2] == 48
    exact, checkpointed = runs["exact"][1], runs["checkpointed"][1]
    assert all(torch.allclose(exact[k], checkpointed[k], atol=1e-6) for k in exact)
    assert any(t.abs().sum() > 0 for n, t in checkpointed.items() if "lora_B" in n)


# TRL's fused LM head fitted to a CPU (`training/fused_head.py`): small tiles, labelled positions only.


@pytest.fixture
def trl_head(monkeypatch):
    """TRL's fused-head globals at TRL's own values (an earlier test's stage may have fitted them: the fit is
    process-wide), restored after the test whatever it sets; the installed TRL must still have every name."""
    import trl.kernels.chunked_logprob as kernels
    import trl.trainer.utils as utils

    monkeypatch.setattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768, raising=True)
    monkeypatch.setattr(utils, "_use_triton", kernels._use_triton, raising=True)  # TRL's: imported from the kernels
    monkeypatch.setattr(kernels, "TOKEN_CHUNK_SIZE", 4096, raising=True)
    return utils, kernels


def fused_step(utils, seed: int = 0):
    """Loss and LoRA-free gradients of one fused-head pass of a tiny Llama, and the rows each tile fold saw."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config)
    utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(0, 1000, (3, 21))
    labels = ids.clone()
    labels[:, :15] = -100
    labels[2, 17:] = -100  # a shorter answer: padding
    rows = []
    apply = utils._ChunkedLogProbFunction.apply

    def spy(hidden, *args):
        rows.append(hidden.shape[0])
        return apply(hidden, *args)

    utils._ChunkedLogProbFunction.apply = spy
    try:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    finally:
        utils._ChunkedLogProbFunction.apply = apply
    (out.loss + out.entropy.sum() * 0.01).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, rows, int((labels[:, 1:] != -100).sum())


def test_fused_head_fitted_to_cpu_scores_labelled_positions_in_small_tiles(trl_head, monkeypatch):
    from alignment.training import fused_head

    utils, kernels = trl_head
    before, grads_before, rows_before, labelled = fused_step(utils)
    assert rows_before == [3 * 20]  # TRL's CPU default: every position, prompts and padding included
    monkeypatch.setattr(fused_head, "CPU_TOKEN_TILE", 4)  # several token and vocabulary tiles on a tiny model
    monkeypatch.setattr(fused_head, "CPU_VOCAB_TILE", 300)
    assert fused_head.fit_fused_head_to_cpu()
    assert fused_head.fit_fused_head_to_cpu()  # idempotent: wrapped once
    assert kernels.TOKEN_CHUNK_SIZE == 4 and utils._CHUNKED_LOGPROB_CHUNK_SIZE == 300
    assert utils._use_triton(torch.device("cpu")) and not kernels._use_triton(torch.device("cpu"))
    after, grads_after, rows_after, _ = fused_step(utils)
    assert rows_after == [labelled]  # the memory-saving path: only the labelled positions reach the tiles
    assert abs(float(after.loss) - float(before.loss)) < 1e-6
    for field in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(after, field), getattr(before, field), atol=1e-6, rtol=0)
    assert torch.equal(after.is_top1, before.is_top1)
    assert grads_after.keys() == grads_before.keys()
    for name, grad in grads_before.items():
        torch.testing.assert_close(grads_after[name], grad, atol=1e-6, rtol=1e-5)


def test_trl_args_fit_the_fused_head(trl_head, tmp_path):
    """Every TRL-backed stage builds its config through `StageContext.trl_args`, which fits the head first."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import sft

    utils, kernels = trl_head
    recipe = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "sft", {"data": {"task": "arithmetic", "n": 8}})))
    sft.trl_config(make_context(recipe, "sft"))
    assert getattr(utils._use_triton, "fitted_to_cpu", False)
    assert kernels.TOKEN_CHUNK_SIZE <= 512
