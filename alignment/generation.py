"""The one batched sampling path, used by ppo, rsft, on-policy preference data and evaluation.

`generate(model, tokenizer, prompts, settings)` renders nothing itself: prompts arrive already
rendered by `formatting.render_prompt`. It sorts prompts by length so each batch pads little,
left-pads (decoder-only models continue from the right edge), samples `n` completions per prompt,
stops at the end-of-turn token, and returns completions in the caller's order with their token ids,
so RL code can score the exact tokens that were sampled.

`cache: static` preallocates the KV cache (transformers' StaticCache) and pads prompt widths up to
multiples of 64, so every decode step has the same shapes; on a GPU, transformers then compiles the
decode step (torch.compile, CUDA graphs), which removes the per-token Python/launch overhead that
bounds eager decoding (see docs/performance.md). On CPU nothing is compiled and the static cache only
costs memory, so the default `dynamic` is kept there; `static` is opt-in until it is measured on a GPU.

`merge_lora` (default on) folds the active LoRA adapter into the base weights while sampling
(`lora_merged`), so each adapted layer runs one matmul per decode step instead of three: 1.2-1.3x the
tokens/s of the unmerged adapter on CPU (docs/performance.md). The base weights are copied first and
copied back afterwards, not unmerged by subtraction: W + BA - BA drifts in bf16 after many updates, and
the base weights also serve as the reference policy. The price is one copy of the adapted weights for
the duration of the call; `merge_lora: false` avoids it when memory is that tight.

`backend: vllm` hands the sampling to a vLLM engine in this process (`vllm_backend.py`: weights pushed
before every call, sampler log-probs checked against the policy's); `transformers` (the default) is
this module's own loop and runs anywhere.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator

from .schema import Strict
from .vllm_backend import VllmSpec, vllm_missing


class SamplerChoice(Strict):
    """Who samples; shared by every sampling block (SamplingSpec and ppo's `rollout:`)."""

    backend: Literal["transformers", "vllm"] = Field("transformers", description="who samples: this toolkit's "
                                                     "generate loop, or a vLLM engine (GPU; see vllm_backend.py)")
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="engine settings, used with `backend: vllm`")

    @field_validator("backend")
    @classmethod
    def _vllm_installed(cls, backend: str) -> str:
        if backend == "vllm" and (why := vllm_missing()):
            raise ValueError(why)
        return backend


class SamplingSpec(SamplerChoice):
    """Sampling settings; `temperature: 0` means greedy decoding."""

    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, gt=0, description="completions per prompt")
    batch_size: int = Field(64, gt=0, description="sequences per generate call (vLLM schedules its own batches)")
    cache: Literal["dynamic", "static"] = Field("dynamic", description="static: fixed-shape KV cache, compiled "
                                                "decoding on GPU (see module docstring)")
    merge_lora: bool = Field(True, description="fold the active LoRA adapter into the base weights while sampling "
                             "(faster decoding, one temporary copy of the adapted weights); vLLM always "
                             "receives merged weights")


STATIC_WIDTH_STEP = 64  # static cache: prompt widths rounded up to this, so few distinct shapes are compiled


@dataclass
class Sample:
    prompt_index: int
    text: str  # completion text without special tokens
    token_ids: list[int] = field(default_factory=list)  # sampled ids, through the stop token if one was sampled
    finished: bool = False  # ended with the end-of-turn / EOS token


def stop_token_ids(tokenizer) -> list[int]:
    from .formatting import end_of_turn

    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))}
    return sorted(i for i in ids if i is not None)


def generate(model, tokenizer, prompts: list[str], settings: SamplingSpec, progress: str | None = None) -> list[Sample]:
    """`settings.n` samples per prompt, ordered prompt by prompt (sample j of prompt i at i*n+j)."""
    import torch

    if settings.backend == "vllm":
        from . import vllm_backend

        return vllm_backend.generate(model, tokenizer, prompts, settings, progress)

    from .progress import track

    stops = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(settings.n)]
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    # Longest first: similar lengths share a batch, and an out-of-memory error shows up at once.
    jobs.sort(key=lambda job: -len(encoded[job[0]]))
    results: dict[tuple[int, int], Sample] = {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batches = [jobs[s : s + settings.batch_size] for s in range(0, len(jobs), settings.batch_size)]
    with torch.no_grad(), lora_merged(model) if settings.merge_lora else nullcontext():
        for batch in track(batches, description=progress or "generating", disable=progress is None):
            rows = [encoded[i] for i, _ in batch]
            width = max(len(r) for r in rows)
            if settings.cache == "static":
                width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
            input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
            attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
            output = model.generate(
                input_ids=input_ids, attention_mask=attention, max_new_tokens=settings.max_new_tokens,
                do_sample=settings.temperature > 0, temperature=settings.temperature or None,
                top_p=settings.top_p if settings.temperature > 0 else None,
                top_k=settings.top_k if settings.temperature > 0 else None,
                eos_token_id=stops, pad_token_id=pad_id,
                # Plain samples: a checkpoint's own generation_config (e.g. a repetition penalty) must not
                # reshape the distribution that KL and PPO log-probs assume we sampled from.
                repetition_penalty=1.0, no_repeat_ngram_size=0,
                **({"cache_implementation": "static"} if settings.cache == "static" else {}),
            )
            for (i, j), ids in zip(batch, output[:, width:].tolist()):
                results[(i, j)] = to_sample(i, ids, stops, tokenizer)
    model.train(was_training)
    return [results[(i, j)] for i in range(len(prompts)) for j in range(settings.n)]


@contextmanager
def lora_merged(model):
    """Within the block, the model's active LoRA adapters are merged into its base layers; on leaving,
    the base weights are restored bit for bit from a copy. A model without LoRA layers is left alone."""
    from peft.tuners.lora import LoraLayer

    import torch

    from .errors import UserError

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
            raise UserError(f"Out of memory while merging the LoRA adapter for sampling, which keeps a copy of the "
                            f"adapted weights ({mib:.0f} MiB) so they can be restored exactly. Set "
                            "`merge_lora: false` in this stage's sampling block (`rollout:` of ppo, `sampling:` of "
                            "rsft or an evaluation suite) to sample through the unmerged adapter instead.") from error
        yield model
    finally:
        for layer, weight, bias in saved:
            base = layer.get_base_layer()
            base.weight.data.copy_(weight)
            if bias is not None:
                base.bias.data.copy_(bias)
            layer.merged_adapters.clear()  # the layer runs its adapter again in its forward pass


def to_sample(prompt_index: int, ids: list[int], stops: list[int], tokenizer) -> Sample:
    end = next((k for k, t in enumerate(ids) if t in stops), None)
    kept = ids if end is None else ids[: end + 1]
    text = tokenizer.decode(kept, skip_special_tokens=True)
    return Sample(prompt_index=prompt_index, text=text, token_ids=kept, finished=end is not None)
