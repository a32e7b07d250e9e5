"""Our own decode loop for one batch (`engine: loop`, see sampling/hf.py): the steps `model.generate` wastes, left out.

`decode_batch(model, input_ids, attention, sources, settings, stops, pad_id)` returns the generated ids of every
row (and their log-probs), as `model.generate` would for the same left-padded batch, minus four kinds of work:
a prompt shared by several rows (`n` samples) is prefilled once and its cache copied to its rows
(`prefill_once`); with `share_prefix` (the default) the tokens every prompt starts with (a system prompt) run
once (`models.prefix`), so those rows' logits differ from `generate`'s in their last bits; a row that sampled
a stop token leaves the batch (compaction, `COMPACT_SHARE`); each layer's cache grows into reserved room
(`kv_cache.ReservedLayer`). What stays exactly as in `generate`, and why the ids match: `decode_batch`.

Not covered: sharded models (FSDP2 needs every process to run the same number of forwards: hf.py sends them
to `generate`), the static cache and compiled decoding (fixed shapes, which compaction changes: `generate`
too), models whose cache is not a `DynamicCache` of plain layers (sliding-window or linear-attention
layers: not checked).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from peft import PeftModel
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..config.sampling import SamplingSpec
from ..models.prefix import cache_name, prefix_cache, takes_logits_to_keep, takes_position_ids
from .kv_cache import reserved_cache

# The prefills `prefills_kept` keeps while its block runs ({batch: (logits, cache, mask, positions)}), else None.
_kept: dict | None = None

# Compaction copies every layer's cache once: it is done when at least this share of the rows still in the
# batch has finished, so a batch whose rows end one by one is not copied at every step.
COMPACT_SHARE = 0.125

# Entries per chunk of a row in `first_argmax`: a divisor of common vocabularies (SmolLM2's 49,152 = 48 * 1024).
ARGMAX_CHUNK = 1024


def warpers(settings: SamplingSpec) -> LogitsProcessorList:
    """The logits warpers `model.generate` applies for these settings (its `_get_logits_processor`, sampling
    branch, with every other field at transformers' default): same classes, same order."""
    processors = LogitsProcessorList()
    if settings.temperature <= 0:
        return processors
    if settings.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=settings.top_k, min_tokens_to_keep=1))
    if settings.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=settings.top_p, min_tokens_to_keep=1))
    return processors


@contextmanager
def prefills_kept():
    """Within the block, a batch of prompts the loop prefills again (the same model, the same distinct prompts,
    padding and shared prefix) starts from the first prefill's cache and last logits, copied, instead of running
    the model over the prompts again. For a model whose weights do not change inside the block: an evaluation
    suite's greedy answers and its temperature-1 KL samples of one checkpoint share their prefills. The samples
    are a fresh prefill's, bit for bit: the same computation, done once (tests/test_sampling.py)."""
    global _kept
    outer, _kept = _kept, {} if _kept is None else _kept
    try:
        yield
    finally:
        _kept = outer


def prefill_once(
    model, input_ids: torch.Tensor, attention: torch.Tensor, sources: list[int], prefix: torch.Tensor | None = None
):
    """Run the prompts of `input_ids` (one row per distinct prompt) and give row r of the batch the cache, last
    logits and positions of prompt `sources[r]`. With `prefix` [P] (the tokens every prompt starts with, left out
    of `input_ids`) that is run once first, its cache copied to every prompt's row, and the rows continue it:
    [prefix, left padding, rest], positions counted over real tokens only. Returns (fp32 logits [batch, vocab],
    cache, the attention mask `generate` would pass (None where no row is padded), position ids of the last
    token [batch, 1] or None). Inside `prefills_kept` a batch prefilled before is copied, not run again."""
    key = (
        None
        if _kept is None
        else (
            id(model),
            next(model.parameters()).dtype,
            tuple(map(tuple, input_ids.tolist())),
            tuple(map(tuple, attention.tolist())),
            None if prefix is None else tuple(prefix.tolist()),
        )
    )
    if key in (_kept or {}):
        logits, cache, mask, positions = _kept[key]
        logits, cache = logits.clone(), copy.deepcopy(cache)  # each call decodes (and grows) its own copy
    else:
        logits, cache, mask, positions = prefill(model, input_ids, attention, prefix)
        if key is not None:  # kept intact for the next call: this one grows its own
            _kept[key] = (logits.clone(), copy.deepcopy(cache), mask, positions)
    if sources != list(range(input_ids.shape[0])):
        index = torch.tensor(sources, device=input_ids.device)
        cache.batch_select_indices(index)
        logits = logits[index]
        mask = None if mask is None else mask[index]
        positions = None if positions is None else positions[index]
    return logits, cache, mask, positions


def prefill(model, input_ids: torch.Tensor, attention: torch.Tensor, prefix: torch.Tensor | None = None):
    """`prefill_once`'s forward pass, one row per distinct prompt: (fp32 last logits, cache, mask, positions)."""
    # Only the last position's logits, as `generate` asks for them: the LM head on every prompt position would
    # cost as much as the whole decode of a short completion (a [rows, prompt, vocab] product).
    last = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    shared = 0
    cache = reserved_cache(model)
    if prefix is not None:  # run for its keys and values only: it asks the head for no logits
        shared = prefix.shape[0]
        cache = prefix_cache(model, prefix, input_ids.shape[0], cache)
        attention = torch.cat([attention.new_ones((input_ids.shape[0], shared)), attention], dim=-1)
    positions = None
    if takes_position_ids(model):  # as `generate` decides it
        positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 0)[:, shared:]
    mask = None if bool((attention == 1).all()) else attention
    with contiguous_head_input(model):
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            return_dict=True,
            **{cache_name(model): cache},
            **last,
        )
    logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    del out
    return logits, cache, mask, None if positions is None else positions[:, -1:]


@contextmanager
def contiguous_head_input(model):
    """Within the block, a CPU model with bf16 or fp16 weights gets its LM head's input as a compact copy. The
    prefill keeps one position of each row (`logits_to_keep=1`: hidden states [rows, 1, hidden] sliced out of
    [rows, prompt, hidden], a strided view). torch's matmul folds such an input into one matrix product (copying
    it) only when the weight requires grad; a frozen head (evaluated checkpoints, reference models, a LoRA
    policy's base) gets a batched product over the weight copied once per row
    (https://github.com/pytorch/pytorch/issues/151934, open): a [rows, hidden, vocab] copy that costs the
    prefill orders of magnitude more than a compact input does (measured: docs/performance.md). fp32 weights
    keep `generate`'s path (a frozen head's is slower there too, but `engine: loop`'s fp32 logits are
    `generate`'s bit for bit without a shared prefix, which the folded product is not)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    # clone, not .contiguous(): a one-row slice [1, 1, hidden] (a batch of one distinct prompt, n samples of it)
    # counts as contiguous whatever its strides, and the slow path goes by the strides
    handle = head.register_forward_pre_hook(
        lambda module, args: (args[0].clone(memory_format=torch.contiguous_format), *args[1:])
    )
    try:
        yield
    finally:
        handle.remove()


def decode_batch(
    model,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    sources: list[int],
    settings: SamplingSpec,
    stops: list[int],
    pad_id: int,
    prefix: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Decode `len(sources)` rows; row r continues prompt row `sources[r]` of `input_ids` (left-padded, one row
    per distinct prompt, each after `prefix` [P] where one is given). Returns each row's ids up to and including
    its stop token (or `max_new_tokens` of them) and the log-prob of each under the distribution it was drawn
    from (`Sample.logprobs`).

    What stays exactly as in `model.generate` (transformers 5.x `_sample`): the forward calls' arguments (the
    dynamic cache; the left-padded attention mask grown by a column of ones per step, or none where no row is
    padded; position ids counted from each row's first real token where the model's forward takes them; a PEFT
    model's inner model called, as PEFT's `generate` calls it; the prefill's LM head on the last position only,
    on a compact copy of its input for bf16 or fp16 weights on CPU, `contiguous_head_input`), the fp32 copy of
    the last position's logits, the logits warpers (`warpers`), and the random draws (`next_tokens`): one
    `torch.multinomial` over a [batch, vocab] tensor per step, batch being the whole batch the step would have
    had in `generate`. torch draws a single sample per row as argmax(p / q) with q exponential noise laid out
    over the tensor's shape, so a row's draw depends only on its own probabilities and its place in the batch;
    finished rows get a one-hot stand-in and the running rows draw what they would have drawn in `generate`
    (tests/test_sampling.py). So greedy and sampled ids equal `generate`'s as far as the model's arithmetic
    gives the same logits for a row in a smaller batch: BLAS kernels may sum in another order for another batch
    size, which moves a logit in its last bits (the ids stayed the same on every sampling path of
    tests/test_sampling_paths.py; a near-tie between two tokens could still flip one). Not checked on a GPU."""
    batch, steps, device = len(sources), settings.max_new_tokens, input_ids.device
    model = model.get_base_model() if isinstance(model, PeftModel) else model  # the model `generate` runs
    logits, cache, attention, positions = prefill_once(model, input_ids, attention, sources, prefix)
    process, cache_arg = warpers(settings), cache_name(model)
    stop_ids = torch.tensor(stops, device=device)
    # Written on the device, read once at the end: no host round trip per row and step.
    ids = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    processed = torch.zeros((batch, steps), dtype=torch.float32, device=device) if truncates(settings) else logprobs
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    live = torch.arange(batch, device=device)  # batch row of each row still in the model's batch
    running = torch.ones(batch, dtype=torch.bool, device=device)  # over `live`: not finished yet
    for step in range(steps):
        rows = live[running]
        tokens, drawn_logprobs, drawn_processed = next_tokens(process, logits, rows, batch, settings, pad_id)
        ids[rows, step], logprobs[rows, step], processed[rows, step] = tokens, drawn_logprobs, drawn_processed
        lengths[rows] += 1
        ended = torch.isin(tokens, stop_ids)
        running[running.clone()] = ~ended
        still = int(running.sum())  # the one host sync of a step, as `generate` has its own
        if still == 0 or step + 1 == steps:
            break
        # Finished rows are fed the pad token until compaction drops them, as `generate` feeds them.
        feed = torch.full((len(live),), pad_id, device=device)
        feed[running] = tokens[~ended]
        if attention is not None:
            attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=-1)
        if positions is not None:
            positions = positions + 1
        if len(live) - still >= max(1, COMPACT_SHARE * len(live)):
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, feed = live[keep], feed[keep]
            attention = None if attention is None else attention[keep]
            positions = None if positions is None else positions[keep]
            running = torch.ones(len(live), dtype=torch.bool, device=device)
        out = model(
            input_ids=feed[:, None],
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            return_dict=True,
            **{cache_arg: cache},
        )
        logits = last_logits(out.logits, running, every=still == len(live))
        del out
    counts = lengths.tolist()
    return rows_of(ids, counts), rows_of(logprobs, counts), rows_of(processed, counts)


def rows_of(values: torch.Tensor, counts: list[int]) -> list[list]:
    """Each row of [rows, steps] `values` cut to its length."""
    return [row[:k] for row, k in zip(values.tolist(), counts)]


def truncates(settings: SamplingSpec) -> bool:
    """Whether top-k or top-p cut the distribution tokens are drawn from, so that the processed log-probs
    (`Sample.processed_logprobs`) differ from log-softmax(logits / temperature)."""
    return settings.temperature > 0 and (settings.top_k != 0 or settings.top_p < 1.0)


def next_tokens(
    process: LogitsProcessorList,
    logits: torch.Tensor,
    rows: torch.Tensor,
    batch: int,
    settings: SamplingSpec,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next token of each running row (`logits` [running, vocab], `rows` their places in the batch), its
    log-prob before truncation (`Sample.logprobs`: log-softmax of logits / temperature, before top-k/top-p;
    temperature 1 when greedy) and its processed log-prob (`Sample.processed_logprobs`: log-softmax of the warped
    scores it was drawn from; the same tensor where nothing truncates). `draw: generate` draws over the whole
    batch's shape, finished rows standing in as a one-hot on `pad_id`, so the running rows get the random numbers
    `generate` would have given them; `draw: inverse_cdf` draws one uniform number per running row (`inverse_cdf`)."""
    scores = process(None, logits)
    if settings.temperature <= 0:
        tokens = first_argmax(scores)
    elif settings.draw == "inverse_cdf":
        tokens = inverse_cdf(torch.softmax(scores, dim=-1))
    elif len(rows) == batch:  # every row running (rows is then 0..batch-1): no stand-ins to write
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        probs = torch.zeros((batch, logits.shape[-1]), dtype=scores.dtype, device=scores.device)
        probs[:, pad_id] = 1.0
        probs[rows] = torch.softmax(scores, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1).squeeze(1)[rows]
    # x / 1.0 is x: the division is skipped where it changes nothing
    scaled = logits / settings.temperature if settings.temperature not in (0.0, 1.0) else logits
    raw = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    if not truncates(settings):
        return tokens, raw, raw
    return tokens, raw, torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def last_logits(logits: torch.Tensor, running: torch.Tensor, every: bool) -> torch.Tensor:
    """The fp32 logits [running, vocab] of the last position of a forward's `logits` [batch, positions, vocab],
    the rows where `running` (over the batch) is set; `every`: all of them are. The values `generate`'s
    `logits[:, -1].to(copy=True, dtype=torch.float32)` gives, copied at most once: the mask's selection is a new
    tensor already, and fp32 logits of every row are the forward's own (nothing edits them in place: the warpers
    return new tensors). Each copy spared is a [rows, vocab] fp32 tensor at every decode step."""
    last = logits[:, -1]
    return (last if every else last[running]).float()  # `float()` of fp32 is the tensor itself


def first_argmax(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)` of [rows, vocab], the same index: the first of equal maxima, and the first NaN in a
    row that has one (argmax ranks NaN above every number). Found in two short passes on CPU: the maximum of each
    ARGMAX_CHUNK entries (a vectorized reduction that propagates NaN), the first chunk holding the row's maximum
    (argmax over the chunks' maxima), then argmax within that chunk. torch's argmax on CPU walks a row one entry
    at a time, several times slower at a large vocabulary, every greedy decode step (measured:
    docs/performance.md, "A step's passes over the vocabulary").
    Elsewhere (a GPU) and on rows shorter than two chunks it is torch's argmax."""
    rows, vocab = scores.shape
    if scores.device.type != "cpu" or vocab < 2 * ARGMAX_CHUNK or rows == 0:
        return scores.argmax(dim=-1)
    whole = vocab - vocab % ARGMAX_CHUNK
    maxima = scores[:, :whole].unflatten(-1, (-1, ARGMAX_CHUNK)).amax(dim=-1)  # [rows, chunks]
    if whole < vocab:  # the remainder is a last, shorter chunk
        maxima = torch.cat([maxima, scores[:, whole:].amax(dim=-1, keepdim=True)], dim=-1)
    chunk = maxima.argmax(dim=-1)
    # the chunk's columns; past the vocabulary's end (a shorter last chunk) they repeat the last entry, after it,
    # so they never come first
    columns = (chunk[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=scores.device)).clamp_(max=vocab - 1)
    within = scores.gather(1, columns).argmax(dim=-1, keepdim=True)
    return columns.gather(1, within).squeeze(1)


def inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], drawn with one uniform number u per row: the token whose span of
    the cumulative probabilities (fp64, so 49k small terms add up without drift) holds u x the row's total. Token t
    is drawn with probability probs[t] / total; a token of probability 0 (cut by top-k or top-p) has an empty span
    and is never drawn (the search returns the first bound above u x total). `torch.multinomial`, as `generate`
    calls it, draws an exponential number per token instead: on CPU that is most of a sampled step's time at a
    large vocabulary (measured: docs/performance.md)."""
    cumulative = probs.double().cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
