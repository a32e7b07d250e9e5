"""The one sampling path, used by ppo, rsft, on-policy preference data, evaluation and tool rollouts.

    samples = generate(model, tokenizer, rendered_prompts, SamplingSpec(n=4, max_new_tokens=32))
    samples = generate_ids(model, tokenizer, prompt_ids, settings, logprobs=True)  # ids in, ids out

`settings.backend` chooses the sampler: `transformers` (the default, `hf.py`: this toolkit's own
batched loop, runs anywhere) or `vllm` (`vllm_engine.py`: a vLLM engine in this process, weights pushed
before every call, its log-probs checked against the policy's). Both return `samples.Sample`s in the
caller's order (sample j of prompt i at i*n+j), with the exact token ids that were sampled, so RL code
scores what was sampled.
"""

from __future__ import annotations

from ..config.sampling import SamplingSpec
from . import hf, vllm_engine
from .decode import prefills_kept
from .samples import Sample, lora_merged, stop_token_ids

__all__ = [
    "Sample",
    "SamplingSpec",
    "close",
    "generate",
    "generate_ids",
    "lora_merged",
    "prefills_kept",
    "stop_token_ids",
]


def generate(model, tokenizer, prompts: list[str], settings: SamplingSpec, progress: str | None = None) -> list[Sample]:
    """`settings.n` completions of every rendered prompt; `progress` names a progress bar (None: no bar)."""
    sampler = vllm_engine if settings.backend == "vllm" else hf
    return sampler.generate(model, tokenizer, prompts, settings, progress)


def generate_ids(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    settings: SamplingSpec,
    progress: str | None = None,
    logprobs: bool = False,
    processed: bool = False,
) -> list[Sample]:
    """`generate` on prompts given as token ids, fed to the sampler as they are (multi-turn rollouts continue
    the ids they hold), optionally with the sampler's log-prob of each sampled token (`Sample.logprobs`);
    `processed`: also those after temperature and top-k/top-p (`Sample.processed_logprobs`, what importance
    sampling divides by)."""
    if settings.backend == "vllm":
        return vllm_engine.generate_ids(model, tokenizer, prompt_ids, settings, progress, logprobs, processed)
    return hf.generate_ids(model, tokenizer, prompt_ids, settings, progress, logprobs or processed)


def close() -> None:
    """Shut down any sampling engine this process started (a vLLM engine's exit hook tears down sub-groups of
    the torch.distributed group, so it must go before that group does); a no-op where none was started."""
    vllm_engine.close(final=True)
