"""What both samplers share: the `Sample` they return, the stop ids, the checkpoint's sampling defaults turned
off, LoRA merged for sampling, the weights cast for the call, and bf16 linear layers on weights laid out once for
oneDNN's kernels."""

from __future__ import annotations

import platform
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, partial

import torch
from peft.tuners.lora import LoraLayer
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary
from transformers import GenerationConfig, GenerationMixin

from ..data.formatting import end_of_turn
from ..errors import UserError


@dataclass
class Sample:
    prompt_index: int
    text: str  # completion text without special tokens
    token_ids: list[int] = field(default_factory=list)  # sampled ids, through the stop token if one was sampled
    finished: bool = False  # ended with the end-of-turn / EOS token
    # log p(token) of each of `token_ids` under the distribution it was drawn from, before top-k/top-p truncation
    # (fp32 log-softmax of logits / temperature; temperature 1 when greedy): computed on the way by `engine: loop`,
    # on request by `hf.generate_ids(..., logprobs=True)`, under `dtype: bfloat16` the bf16 weights' (those that drew
    # the token); None where the sampler does not compute them. The vLLM
    # backend's (`vllm_engine.generate_ids(..., logprobs=True)`) are the temperature-1 ones at any temperature:
    # the same at temperature 1 and greedy (vllm_engine's docstring says why)
    logprobs: list[float] | None = None
    # log p(token) under the distribution the token was actually drawn from: after temperature and top-k/top-p (the
    # "processed" log-probs, vLLM's `processed_logprobs`), what an importance-sampling correction divides by (a
    # truncated sampler's ratio is otherwise biased). Equal to `logprobs` without truncation; None where the sampler
    # does not compute them
    processed_logprobs: list[float] | None = None


# What a plain generation config keeps of a checkpoint's generation_config.json: its token ids, nothing that
# shapes the distribution.
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def as_ids(value) -> list[int]:
    """A token-id setting (None, one id or a list) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """The one stop set of every sampler: the tokenizer's EOS, the chat template's end-of-turn token and every
    EOS id the checkpoint's generation_config lists (Qwen2.5-Instruct lists two)."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))}
    ids |= set(as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    return sorted(i for i in ids if i is not None)


def plain_generation_config(config: GenerationConfig) -> GenerationConfig:
    """`config` with transformers' defaults for every sampling field: only the token ids are kept."""
    return GenerationConfig(**{k: getattr(config, k) for k in TOKEN_FIELDS if getattr(config, k, None) is not None})


@contextmanager
def checkpoint_sampling_defaults_off(model):
    """Within the block, every generation config inside `model` is plain (`plain_generation_config`).
    transformers fills each sampling field a caller leaves unset from the checkpoint's generation_config.json
    (a min_p, a repetition penalty, min_new_tokens): the samples would then come from another distribution
    than the one the recipe names and that PPO's ratios, the KL estimates and pass@k assume."""
    models = [m for m in model.modules() if isinstance(m, GenerationMixin) and m.generation_config is not None]
    saved = [m.generation_config for m in models]
    try:
        for m in models:
            m.generation_config = plain_generation_config(m.generation_config)
        yield model
    finally:
        for m, config in zip(models, saved):
            m.generation_config = config


@contextmanager
def lora_merged(model):
    """Within the block, the model's active LoRA adapters are merged into its base layers; on leaving,
    the base weights are restored bit for bit from a copy. A model without LoRA layers is left alone.

    Merged, each adapted layer runs one matmul per decode step instead of three. The base is copied back, not
    unmerged by subtraction: W + BA - BA drifts in bf16 after many updates, and the base weights also serve as
    the reference policy. The price is one copy of the adapted weights for the duration of the block
    (`merge_lora: false` avoids it when memory is that tight)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.disable_adapters and not m.merged]
    saved = []
    try:
        try:
            for layer in layers:
                base = layer.get_base_layer()
                bias = getattr(base, "bias", None)
                saved.append((layer, base.weight.detach().clone(), None if bias is None else bias.detach().clone()))
                layer.merge()
        except torch.OutOfMemoryError as error:
            weights = [layer.get_base_layer().weight for layer in layers]
            mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
            raise UserError(
                f"Out of memory while merging the LoRA adapter for sampling, which keeps a copy of the "
                f"adapted weights ({mib:.0f} MiB) so they can be restored exactly. Set "
                "`merge_lora: false` in this stage's sampling block (`rollout:` of ppo, `sampling:` of "
                "rsft or an evaluation suite) to sample through the unmerged adapter instead."
            ) from error
        yield model
    finally:
        for layer, weight, bias in saved:
            base = layer.get_base_layer()
            base.weight.data.copy_(weight)
            if bias is not None:
                base.bias.data.copy_(bias)
            layer.merged_adapters.clear()  # the layer runs its adapter again in its forward pass


def engine_managed(param: torch.Tensor) -> bool:
    """Whether `param`'s storage belongs to a sharding engine: an FSDP2 DTensor, or a ZeRO-3 parameter (DeepSpeed
    marks each with `ds_id`): sampling neither casts it in place nor lays it out for oneDNN."""
    return isinstance(param, DTensor) or hasattr(param, "ds_id")


# The typed copies `weights_as` fills at each call, kept per CPU parameter between calls (dropped with it). A fresh
# copy touches every page anew (page faults), where re-filling the kept one is about half the time (measured:
# docs/performance.md). Costs the copy's memory between calls. On a GPU the caching allocator reuses memory
# anyway, and the memory is scarcer: nothing is kept there.
_typed_copies = WeakIdKeyDictionary()


def typed_copy(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`param`'s values in `dtype`, as `param.data.to(dtype)` gives them, written (on CPU) into the copy kept from the
    previous call when there is one of the same shape: every call re-fills it, so it is never stale."""
    if param.device.type != "cpu":
        _typed_copies.pop(param, None)  # a CPU copy from before the model moved goes now
        return param.data.to(dtype)
    kept = _typed_copies.get(param)
    if kept is None or kept.shape != param.shape or kept.dtype != dtype:
        kept = _typed_copies[param] = torch.empty_like(param.data, dtype=dtype)  # strides as `.to` keeps them
    return kept.copy_(param.data)


@contextmanager
def weights_as(model, dtype: str):
    """Within the block, the model's floating-point parameters are `dtype` ("bfloat16"; "model": left as they are);
    on leaving, the model's own tensors are put back, untouched (no cast back: the same storage). Tied parameters
    are one parameter and are cast once; buffers (rotary frequencies) keep their type, as the models compute with
    them in fp32 anyway. On CPU the typed copies are kept for the next call (`typed_copy`). A sharded (FSDP2) or
    ZeRO-3 model's parameters are views its engine manages: refused."""
    if dtype == "model":
        yield model
        return
    target = getattr(torch, dtype)
    params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != target]
    if any(engine_managed(p) for p in params):
        raise UserError(
            f"`dtype: {dtype}` in a sampling block casts the weights in place for the call, which a sharded "
            "(FSDP2) or ZeRO-3 model's engine does not allow: drop `dtype` there (the model samples in its "
            "own type)."
        )
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = typed_copy(p, target)
        yield model
    finally:
        for p, data in zip(params, saved):
            p.data = data


def to_sample(
    prompt_index: int,
    ids: list[int],
    stops: list[int],
    tokenizer,
    logprobs: list[float] | None = None,
    processed: list[float] | None = None,
) -> Sample:
    end = next((k for k, t in enumerate(ids) if t in stops), None)
    kept = ids if end is None else ids[: end + 1]
    text = tokenizer.decode(kept, skip_special_tokens=True)
    return Sample(
        prompt_index=prompt_index,
        text=text,
        token_ids=kept,
        finished=end is not None,
        logprobs=None if logprobs is None else logprobs[: len(kept)],
        processed_logprobs=None if processed is None else processed[: len(kept)],
    )


@cache
def onednn_runs_bf16() -> bool:
    """An x86 CPU on which torch hands its bf16 matmul to oneDNN (AVX-512 or AMX, as far as ONEDNN_MAX_CPU_ISA lets
    oneDNN use them): there a prepacked weight gives torch's own bits; elsewhere torch takes another path, whose sums
    could differ. Natively only with AVX512-BF16 or AMX (`runtime.cpu.bf16_native`, what dtype choices ask)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def packs_for_onednn(module) -> bool:
    """Whether `prepacked_linears` lays out `module`'s weight: a plain `nn.Linear` whose weight is bf16 on a CPU
    where `onednn_runs_bf16`, not a sharded or ZeRO-3 parameter, and not a module whose forward something else
    already replaced (accelerate's hooks)."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, torch.nn.Linear)
        and "forward" not in vars(module)
        and isinstance(weight, torch.Tensor)
        and not engine_managed(weight)
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and onednn_runs_bf16()
    )


@contextmanager
def prepacked_linears(model):
    """Within the block, each bf16 linear layer of a CPU model (`packs_for_onednn`) multiplies by a copy of its
    weight that oneDNN laid out for its bf16 kernel once (`torch.ops.mkldnn._reorder_linear_weight`), where
    `F.linear` hands oneDNN the weight in torch's row-major layout at every call, not in the blocked layout oneDNN
    picks for its kernel. The same products, bit for bit (tests/test_sampling_dtype.py), faster per matmul at
    decode shapes and on a whole bf16 evaluation call (measured: docs/performance.md); the layout itself costs a
    pass over the weights, which is why `hf` prepacks only for long calls. The weights are read when the block opens,
    so it wraps a sampling call, during which they do not
    change; the copies (the bf16 weights' size again) are dropped on leaving and every layer's own forward is
    back."""
    layers = [m for m in model.modules() if packs_for_onednn(m)]
    try:
        for layer in layers:
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
            bias = None if layer.bias is None else layer.bias.detach()  # the call's (bf16) bias, as the weight
            layer.forward = partial(onednn_linear, packed=packed, bias=bias)
        yield model
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a prepacked weight [out, in] (plus bias [out]) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
