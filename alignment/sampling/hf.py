"""The transformers sampler: this toolkit's own batched `generate` loop (`backend: transformers`, the default).

`generate(model, tokenizer, prompts, settings)` takes prompts already rendered by `formatting.render_prompt`,
sorts them by length so each batch pads little, left-pads, samples `n` completions per prompt, stops at
the end-of-turn token, and returns completions in the caller's order with their token ids, so RL code can
score the exact tokens that were sampled. `engine: loop` (`decode.py`, the default) returns the same ids,
stops and random draws as `engine: generate` (one `model.generate` call per batch, the reference; held equal
bit for bit by tests/test_sampling.py) with less work; calls with more rows than `batch_size`, greedy or
with `draw: inverse_cdf`, stream (`stream.py`). A sharded (FSDP2) model and `cache: static` always go
through `generate`. Opt-ins that trade today's exact samples for speed: `dtype: bfloat16`,
`draw: inverse_cdf`; `cache: static` and `compile: true` stay opt-in (slower on CPU, not yet measured on a
GPU); `merge_lora` (default on) samples with the adapter merged (`samples.lora_merged`). Why each default
and what it costs: docs/performance.md.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import CompileConfig

from ..config.sampling import SamplingSpec
from ..data.formatting import encode
from ..errors import UserError
from ..models.prefix import shared_prefix, takes_position_ids
from ..runtime.cpu import warn_slow_bf16
from ..runtime.progress import counting, track
from .decode import decode_batch, truncates
from .samples import (
    Sample,
    checkpoint_sampling_defaults_off,
    lora_merged,
    prepacked_linears,
    stop_token_ids,
    to_sample,
    weights_as,
)
from .stream import decode_stream, streamable

STATIC_WIDTH_STEP = 64  # static cache: prompt widths rounded up to this, so few distinct shapes are compiled
# Calls of at least this many new tokens run bf16 linear layers on prepacked weights (`samples.prepacked_linears`).
# The layout is a pass over the weights per call, which each decode step wins back a little: short calls lose,
# long ones gain (measured: docs/performance.md, "bf16 weights laid out once for oneDNN").
PREPACK_MIN_NEW_TOKENS = 64


def generate(model, tokenizer, prompts: list[str], settings: SamplingSpec, progress: str | None = None) -> list[Sample]:
    """`settings.n` samples per prompt, ordered prompt by prompt (sample j of prompt i at i*n+j)."""
    encoded = [encode(tokenizer, p) for p in prompts]  # the prompt ids training puts before each completion
    return generate_ids(model, tokenizer, encoded, settings, progress)


def generate_ids(
    model,
    tokenizer,
    encoded: list[list[int]],
    settings: SamplingSpec,
    progress: str | None = None,
    logprobs: bool = False,
) -> list[Sample]:
    """`generate` on prompts given as token ids (a multi-turn rollout continues the ids it holds, never
    re-tokenizing them). `logprobs`: each Sample's `logprobs` holds log p(token) of every sampled token under
    the distribution it was drawn from before top-k/top-p (log-softmax of logits / temperature, as TRL's GRPO
    scores them); greedy decoding records the temperature-1 log-probs. `Sample.processed_logprobs` are those after
    top-k/top-p (the distribution drawn from, what importance sampling divides by). `engine: loop` computes both on
    the way whether asked or not."""
    stops = stop_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    jobs = [(i, j) for i in range(len(encoded)) for j in range(settings.n)]
    # Longest first: similar lengths share a batch, and an out-of-memory error shows up at once.
    jobs.sort(key=lambda job: -len(encoded[job[0]]))
    results: dict[tuple[int, int], Sample] = {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    synced = is_sharded(model)
    batches = [jobs[s : s + settings.batch_size] for s in range(0, len(jobs), settings.batch_size)]
    looped = settings.engine == "loop" and settings.cache == "dynamic" and not synced
    if synced and settings.draw != "generate":
        raise UserError(
            "`draw: inverse_cdf` is how this toolkit's decode loop draws tokens, and a sharded (FSDP2) model "
            "samples through `model.generate` (every process must run the same steps): drop `draw` in this "
            "stage's sampling block."
        )
    if settings.dtype == "bfloat16" and device.type == "cpu":
        warn_slow_bf16()  # where bf16 is slow here: `align check` refuses it for a recipe, a program is warned
    merged = lora_merged(model) if settings.merge_lora else nullcontext()
    packed = prepacked_linears(model) if prepacks(settings) else nullcontext()
    with torch.no_grad(), checkpoint_sampling_defaults_off(model), merged, weights_as(model, settings.dtype), packed:
        if looped and streamable(model, settings, len(jobs)):  # waiting rows take finished rows' places
            with counting(progress or "generating", len(jobs), disable=progress is None) as done:
                rows, scores, processed = decode_stream(
                    model, [encoded[i] for i, _ in jobs], settings, stops, pad_id, done
                )
            results = {
                job: to_sample(job[0], ids, stops, tokenizer, score, kept)
                for job, ids, score, kept in zip(jobs, rows, scores, processed)
            }
        else:
            for batch in track(batches, description=progress or "generating", disable=progress is None):
                if looped:
                    rows, scores, processed = via_loop(
                        model, [encoded[i] for i, _ in batch], settings, stops, pad_id, device
                    )
                else:
                    rows, scores, processed = via_generate(
                        model, [encoded[i] for i, _ in batch], settings, stops, pad_id, device, synced, logprobs
                    )
                for (i, j), ids, score, kept in zip(batch, rows, scores, processed):
                    results[(i, j)] = to_sample(i, ids, stops, tokenizer, score, kept)
    model.train(was_training)
    return [results[(i, j)] for i in range(len(encoded)) for j in range(settings.n)]


def prepacks(settings: SamplingSpec) -> bool:
    """Whether a call with these settings runs bf16 linear layers on weights laid out for oneDNN once (the same
    bits; `samples.prepacked_linears`): where it is long enough to pay for the layout, and not under torch.compile,
    which traces the layers' own forward."""
    return settings.max_new_tokens >= PREPACK_MIN_NEW_TOKENS and not settings.compile


def token_logprobs(logits: tuple, sampled, temperature: float):
    """[batch, steps] log-probs of the sampled ids from generate's per-step logits (one [batch, vocab] at a
    time, so no [batch, steps, vocab] tensor is held): raw logits divided by `temperature`, or generate's processed
    scores (after its warpers) with `temperature` 1."""
    scale = temperature if temperature > 0 else 1.0
    columns = [
        torch.log_softmax(step.float() / scale, dim=-1).gather(-1, sampled[:, t : t + 1])
        for t, step in enumerate(logits)
    ]
    return torch.cat(columns, dim=-1).cpu()


def left_padded(rows: list[list[int]], pad_id: int, device, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` left-padded to one width (static cache: rounded up to STATIC_WIDTH_STEP), and the attention mask."""
    width = max(len(r) for r in rows)
    if static:
        width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
    input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return input_ids, attention


def via_generate(
    model,
    rows: list[list[int]],
    settings: SamplingSpec,
    stops: list[int],
    pad_id: int,
    device,
    synced: bool,
    logprobs: bool = False,
) -> tuple[list[list[int]], list, list]:
    """`engine: generate`: one `model.generate` call on the whole batch; each row's generated ids (pad after a
    stop) and, when asked, their log-probs before and after truncation (`token_logprobs`), else None per row.

    With `cache: static` the KV cache is preallocated (transformers' StaticCache) and prompt widths padded up
    to multiples of STATIC_WIDTH_STEP, so every decode step has the same shapes; on a GPU transformers then
    compiles the decode step (torch.compile, CUDA graphs), which removes the per-token Python and launch
    overhead that bounds eager decoding. On CPU nothing is compiled unless `compile: true` asks for it (the
    first call compiles, which takes long)."""
    input_ids, attention = left_padded(rows, pad_id, device, static=settings.cache == "static")
    static = {"cache_implementation": "static"} if settings.cache == "static" else {}
    if settings.compile:  # transformers compiles the static cache's decode step on accelerators only, unless told
        static["compile_config"] = compile_everywhere(device)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=settings.max_new_tokens,
        do_sample=settings.temperature > 0,
        temperature=settings.temperature or None,
        top_p=settings.top_p if settings.temperature > 0 else None,
        top_k=settings.top_k if settings.temperature > 0 else None,
        eos_token_id=stops,
        pad_token_id=pad_id,
        synced_gpus=synced,
        **static,
        **(
            {"output_logits": True, "output_scores": truncates(settings), "return_dict_in_generate": True}
            if logprobs
            else {}
        ),
    )
    sampled = (output.sequences if logprobs else output)[:, input_ids.shape[1] :]
    if not logprobs:
        return sampled.tolist(), [None] * len(rows), [None] * len(rows)
    raw = token_logprobs(output.logits, sampled, settings.temperature).tolist()
    # untruncated (greedy: the temperature-1 log-probs, as for `logprobs`): the same; else the warped scores drawn from
    processed = token_logprobs(output.scores, sampled, 1.0).tolist() if truncates(settings) else raw
    return sampled.tolist(), raw, processed


def compile_everywhere(device) -> CompileConfig:
    """transformers' compile settings for the decode step, flagged to compile on any device (its own flag for
    CPU runs); off CUDA in torch.compile's default mode, as CUDA graphs ("reduce-overhead") need a GPU."""
    config = CompileConfig() if torch.device(device).type == "cuda" else CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


def via_loop(model, rows: list[list[int]], settings: SamplingSpec, stops: list[int], pad_id: int, device):
    """`engine: loop`: each distinct prompt of the batch prefilled once (with `share_prefix`, the tokens they all
    start with once for the whole batch, and each prompt's rest after it), then `decode.decode_batch`."""
    distinct: dict[tuple[int, ...], int] = {}
    sources = [distinct.setdefault(tuple(r), len(distinct)) for r in rows]
    prompts = [list(r) for r in distinct]
    shared = shared_prefix(prompts) if settings.share_prefix and takes_position_ids(model) else 0
    input_ids, attention = left_padded([p[shared:] for p in prompts], pad_id, device)
    prefix = torch.tensor(prompts[0][:shared], device=device) if shared else None
    return decode_batch(model, input_ids, attention, sources, settings, stops, pad_id, prefix)


def is_sharded(model) -> bool:
    """Whether parts of `model` are FSDP2 units, which gather their parameters with every process at each
    forward: then every process must run the same number of decoding steps (`synced_gpus`). Any other model
    decodes on its own; transformers' default would also sync once a ZeRO-3 config exists, and a model sampled
    on one process alone (rsft, evaluation) would then wait for the others forever."""
    return any(isinstance(module, FSDPModule) for module in model.modules())
