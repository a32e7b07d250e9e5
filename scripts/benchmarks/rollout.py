"""The `rollout` section: tokens/s of `sampling.generate` (prompts grouped by length, one big batch) against
plain `model.generate` called per small batch (how TRL's GRPO samples: per-device batch of 8; on the first
`plain_prompts` prompts only, as its rate hardly depends on how many batches it runs); then with a LoRA
adapter, run in the forward pass or merged for sampling (`merge_lora`).
"""

from __future__ import annotations

import random
from pathlib import Path

from .common import Peak, row, text, timed_generate, warm_up


def rollout_setup(model_dir: Path, size: dict):
    """The policy on the device, `prompts` rendered prompts of 8-48 characters, our sampling settings."""
    import torch

    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import render_prompt
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(str(model_dir)), load_policy(str(model_dir))
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    prompts = [render_prompt(tokenizer, text(rng, rng.randint(8, 48))) for _ in range(size["prompts"])]
    spec = SamplingSpec(max_new_tokens=size["new_tokens"], temperature=1.0, batch_size=size["prompts"])
    return tokenizer, model, prompts, spec


def bench_rollout(model_dir: Path, size: dict, args) -> list[dict]:
    tokenizer, model, prompts, spec = rollout_setup(model_dir, size)
    warm_up(model, tokenizer, prompts, spec)
    results = [timed_generate("rollout", "ours: sampling.generate", model, tokenizer, prompts, spec, args)]
    # Plain decoding is bound by per-step overhead, so its rate hardly depends on how many batches of 8 it
    # runs: on a GPU a subset (`plain_prompts`) keeps this row short (measured: docs/performance.md).
    with Peak() as peak:
        tokens = 0
        for start in range(0, size["plain_prompts"], 8):  # what TRL GRPO does per device step
            batch = tokenizer(prompts[start : start + 8], return_tensors="pt", padding=True, padding_side="left").to(
                model.device
            )
            out = model.generate(
                **batch, max_new_tokens=size["new_tokens"], do_sample=True, pad_token_id=tokenizer.pad_token_id
            )
            generated = out[:, batch["input_ids"].shape[1] :]
            tokens += int((generated != tokenizer.pad_token_id).sum())
    results.append(
        row("rollout", "plain: model.generate, batch 8", tokens / peak.seconds, "tokens/s", peak, model, args, False)
    )
    return results + bench_lora_rollout(model, tokenizer, prompts, spec, args)


def bench_lora_rollout(model, tokenizer, prompts, spec, args) -> list[dict]:
    """The policy as PPO samples it with LoRA (r=16 on every linear layer): adapter run in the forward
    pass, against `merge_lora: true` (adapter folded into the base weights while sampling)."""
    import torch

    from alignment.config.model import LoraSpec
    from alignment.models.lora import apply_lora

    model = apply_lora(model, LoraSpec(r=16, lora_alpha=32))  # last: wraps the model's layers in place
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)  # a trained-looking adapter (peft starts B at zero)
    unmerged = spec.model_copy(update={"merge_lora": False})
    warm_up(model, tokenizer, prompts, unmerged)
    return [
        timed_generate("rollout", "ours: LoRA adapter unmerged", model, tokenizer, prompts, unmerged, args),
        timed_generate("rollout", "ours: LoRA merged for sampling", model, tokenizer, prompts, spec, args),
    ]
