"""Sampling through vLLM: `backend: vllm` in any sampling block (`rollout:` of ppo, `sampling:` of rsft,
on-policy preference data and evaluation suites).

vLLM runs in this process beside the policy ("colocated", as TRL's GRPO `vllm_mode: colocate`): each
training process owns one engine on its own GPU and samples its own prompts. The engine is started
from the policy's config with dummy weights (`load_format="dummy"`), and the policy's current weights
are pushed into it before every call (with LoRA: merged through `samples.lora_merged`, so the
base, which is also the reference policy, is restored bit for bit afterwards). Pushing every call
costs one device-to-device copy of the weights, small beside sampling, and means a sampler can never
run on stale weights. One engine serves every model of the same shape in the process (the stages of
one recipe share a base model), so evaluation after training does not start a second engine. With
`vllm.sleep: true` the engine gives its GPU memory back after each call (sleep level 2, as TRL's
`vllm_enable_sleep_mode`) and wakes before the next: weights, push, then the KV cache.

After every call, the first `vllm.check_samples` samples are scored again by the policy, and the
mean absolute difference between vLLM's log-probs of the sampled tokens and the policy's must stay
within `vllm.logprob_tolerance`: a sampler that drifted from the policy (weights not pushed, a
kernel or dtype mismatch, an architecture vLLM implements differently) would otherwise make PPO's
importance ratios and the KL penalty silently wrong. Both sides use the raw distribution (log softmax
of the logits, before temperature or top-p), so the check compares the models, not the settings.

The engine is reached the way TRL 1.16 reaches it (`llm_engine.model_executor.driver_worker.
model_runner.model.load_weights`, with `distributed_executor_backend="external_launcher"`, which
keeps the worker in this process). TRL 1.16 supports vLLM 0.22 to 0.31; the same calls are there in
vLLM 0.33's source. Tested against a stand-in of that interface (tests/fake_vllm); the real engine has
not been run through this module yet (docs/performance.md).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config.sampling import SUPPORTED_VERSIONS, SamplingSpec, VllmSpec
from ..errors import UserError
from ..rl import prompt_completion_batch, sequence_logprobs
from .samples import lora_merged, stop_token_ids, to_sample

log = logging.getLogger(__name__)


@dataclass
class _Engine:
    llm: Any
    shape: str  # the model config (JSON) and settings the engine was built for
    folder: tempfile.TemporaryDirectory
    asleep: bool = False


_engine: _Engine | None = None  # one per process: vLLM reserves its share of GPU memory up front


def generate(model, tokenizer, prompts: list[str], settings: SamplingSpec, progress: str | None = None) -> list:
    """`sampling.generate` with vLLM doing the sampling; same arguments, same result."""


    stops = stop_token_ids(tokenizer, model)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    engine = _engine_for(model, tokenizer, settings.vllm, progress)
    llm = engine.llm
    if engine.asleep:  # weights first, pushed, then the KV cache: the order TRL 1.16 wakes its engine in
        llm.wake_up(tags=["weights"])
    push_weights(llm, model)
    if engine.asleep:
        llm.wake_up(tags=["kv_cache"])
        engine.asleep = False
    params = _sampling_params(settings, stops, len(prompts))
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded], sampling_params=params,
                           use_tqdm=progress is not None)
    if settings.vllm.sleep:  # level 2: weights and KV cache discarded; the next call pushes the weights anyway
        llm.sleep(level=2)
        engine.asleep = True
    samples, sampler_logprobs = [], []
    for i, request in enumerate(outputs):
        for completion in request.outputs:
            sample = to_sample(i, list(completion.token_ids), stops, tokenizer)
            samples.append(sample)
            steps = completion.logprobs or []
            if len(steps) < len(sample.token_ids) and settings.vllm.check_samples:
                raise UserError(f"{progress or 'sampling'}: vLLM returned log-probs for {len(steps)} of "
                                f"{len(sample.token_ids)} sampled tokens, so they cannot be checked against the "
                                "policy's; set `vllm.check_samples: 0` to sample without the check.")
            sampler_logprobs.append([_logprob_of(step, t) for step, t in zip(steps, sample.token_ids)])
    if settings.vllm.check_samples:
        with torch.no_grad():
            gap = logprob_gap(model, tokenizer, encoded, samples[: settings.vllm.check_samples],
                              sampler_logprobs[: settings.vllm.check_samples])
        log.info("vLLM sampler vs policy: mean |log-prob difference| %.4f per token", gap)
        if gap > settings.vllm.logprob_tolerance:
            raise UserError(
                f"{progress or 'sampling'}: vLLM's log-probs of its samples differ from the policy's by {gap:.3f} "
                f"per token on average (more than `vllm.logprob_tolerance: {settings.vllm.logprob_tolerance}`), so "
                "the samples do not come from the policy being trained and PPO ratios and KL would be wrong. "
                "Likely causes: the weights did not reach the engine (a vLLM release outside "
                f"{SUPPORTED_VERSIONS}), a different dtype, or an architecture vLLM implements differently. "
                "Use `backend: transformers`, or raise the tolerance if the gap is expected.")
    return samples


def _sampling_params(settings: SamplingSpec, stops: list[int], count: int) -> list:
    """One SamplingParams per prompt, each with its own seed drawn from torch's generator, so equal
    prompts get different samples and a reseeded run samples the same again."""
    from vllm import SamplingParams

    greedy = settings.temperature == 0
    seeds = torch.randint(0, 2**31 - 1, (count,)).tolist()
    # Every field that shapes the distribution is given (a min_p, penalties, a minimum length stay off).
    return [SamplingParams(n=settings.n, max_tokens=settings.max_new_tokens, temperature=settings.temperature,
                           top_p=1.0 if greedy else settings.top_p, top_k=0 if greedy else settings.top_k,
                           seed=seed, stop_token_ids=stops, logprobs=0, repetition_penalty=1.0, min_p=0.0,
                           min_tokens=0, presence_penalty=0.0, frequency_penalty=0.0,
                           skip_special_tokens=True) for seed in seeds]


def _logprob_of(step: dict, token: int) -> float:
    """vLLM returns, per generated token, {token id: Logprob}; `logprobs=0` asks for the sampled one only."""
    entry = step[token]
    return float(getattr(entry, "logprob", entry))


def _engine_for(model, tokenizer, spec: VllmSpec, where: str | None) -> _Engine:
    """The process's engine, started on first use or when a model of another shape arrives."""
    global _engine

    config = _base_model(model).config
    shape = f"{config.to_json_string()}|{spec.gpu_memory_utilization}|{spec.max_model_len}|{spec.sleep}"
    if _engine is not None and _engine.shape == shape:
        return _engine
    close()
    from vllm import LLM

    folder = tempfile.TemporaryDirectory(prefix="align-vllm-")
    config.save_pretrained(folder.name)
    tokenizer.save_pretrained(folder.name)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    rank, world = 0, 1
    try:
        with _launcher_environment() as (rank, world):
            llm = LLM(model=folder.name, load_format="dummy", dtype=dtype, seed=rank,
                      gpu_memory_utilization=spec.gpu_memory_utilization, max_model_len=spec.max_model_len,
                      # the worker in this process, one engine per training process (TRL's colocate mode)
                      distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                      logprobs_mode="raw_logprobs", enable_sleep_mode=spec.sleep,
                      generation_config="vllm")  # not "auto": no checkpoint's sampling defaults or EOS ids
    except Exception as error:
        folder.cleanup()
        raise UserError(
            f"{where or 'sampling'}: vLLM could not start an engine for this model (process {rank} of {world}): "
            f"{type(error).__name__}: {error}. `backend: vllm` needs a CUDA GPU with "
            f"`vllm.gpu_memory_utilization` of its memory free and a vLLM release from {SUPPORTED_VERSIONS}; "
            "`backend: transformers` samples without vLLM.") from error
    _engine = _Engine(llm, shape, folder)
    return _engine


def close() -> None:
    """Drop the process's engine and free its memory (a new shape needs a new engine)."""
    global _engine

    if _engine is None:
        return
    _engine.folder.cleanup()
    _engine = None
    gc.collect()

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def _launcher_environment():
    """vLLM's external launcher reads torch.distributed's environment variables while the engine starts;
    a single process started without a launcher has none, so give it a world of one for that long
    (left set, they would make later child processes believe they are part of a distributed run).
    Yields (rank, world size)."""

    if dist.is_available() and dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    added = [key for key in single if key not in os.environ]
    os.environ.update({key: single[key] for key in added})
    try:
        yield int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    finally:
        for key in added:
            os.environ.pop(key, None)


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def push_weights(llm, model) -> None:
    """Copy the policy's current weights (LoRA merged) into the engine, then drop its prefix cache,
    which holds keys and values computed with the old weights."""

    try:
        runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError as error:
        raise UserError(f"This vLLM release does not expose its model where TRL 1.16 and this toolkit push weights "
                        f"({error}); use a release from {SUPPORTED_VERSIONS}, or `backend: transformers`.") from error
    with lora_merged(model):
        runner_model.load_weights(vllm_weights(model))
    llm.reset_prefix_cache()


def vllm_weights(model):
    """(checkpoint name, tensor) of every weight, as in the model's own safetensors files: peft's
    wrapper prefixes and `.base_layer` dropped, adapter matrices left out (they are merged)."""
    for name, param in model.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name.replace(".modules_to_save.default", ""), param.data


def logprob_gap(model, tokenizer, prompt_ids: list[list[int]], samples: list, sampler_logprobs: list[list[float]]):
    """Mean |log p_sampler - log p_policy| over the sampled tokens of `samples` (raw log-probs)."""


    rows = [(prompt_ids[s.prompt_index], s.token_ids, lp) for s, lp in zip(samples, sampler_logprobs) if s.token_ids]
    if not rows:
        return 0.0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    ids, attention, mask = prompt_completion_batch([p for p, _, _ in rows], [c for _, c, _ in rows], pad, device)
    k = mask.shape[1]
    sampler = torch.tensor([lp + [0.0] * (k - len(lp)) for _, _, lp in rows], device=device)
    was_training = model.training
    model.eval()
    policy = sequence_logprobs(model, ids, attention, k).float()
    model.train(was_training)
    return float(((policy - sampler).abs() * mask).sum() / mask.sum())
