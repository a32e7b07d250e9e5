"""Continuous batching (`engine: loop`, more rows than `batch_size`, greedy or `draw: inverse_cdf`).

`decode_stream(model, rows, settings, stops, pad_id)` decodes every row of a call with at most `batch_size` rows
in the model's batch at once: when rows stop and leave the batch (the loop's compaction, decode.py), the next
waiting rows are prefilled and take their places, so no step runs on a batch that is mostly finished while rows
are still waiting (batches of fixed rows, decode.decode_batch, pay per batch for its longest answer). Which calls
stream, and why sampled calls with the default draws do not: `streamable`.

The KV cache of the rows in the batch is one `DynamicCache` laid out [shared prefix, middle] (the middle: each
row's own prompt, left-padded, then what it generated). Admitted rows are prefilled on their own (their distinct
prompts once, after the same shared prefix) and their cache joins the batch's with zero columns in the middle
where one side is shorter, masked out (`join`); columns no row attends any more are then dropped (`trim`), so the
cache grows with the longest row in the batch, not with the stream's total steps.
"""

from __future__ import annotations

from collections import deque

import torch
from peft import PeftModel
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..config.sampling import SamplingSpec
from ..models.prefix import cache_name, shared_prefix, takes_position_ids
from .decode import COMPACT_SHARE, last_logits, next_tokens, prefill_once, rows_of, truncates, warpers


def streamable(model, settings: SamplingSpec, rows: int) -> bool:
    """Whether a call goes through `decode_stream`: greedy or `draw: inverse_cdf` (a row's token does not depend on
    the rows beside it), more rows than one batch, a model whose forward takes position ids (an admitted row's
    positions count its own tokens, not the batch's columns) and whose cache is
    made of plain layers (`join` and `trim` edit them).

    With the default draws (`draw: generate`) a sampled row's random draw depends on its place in the batch and
    on how many draws came before its batch (one `torch.multinomial` over [batch, vocab] per step, as `generate`
    draws them), and a batch's number of steps is known only once it ends: admitting a waiting row before then
    would give it other random numbers than today's sampler gives it, so those calls keep batches of fixed rows.
    Greedy rows draw nothing, so their ids are the batched loop's (and `generate`'s), as far as a row's logits do
    not depend on the rows beside it (the caveat of compaction, `decode.decode_batch`). Inverse-CDF rows draw in
    the stream's order, so a seed repeats them, and they are other draws than the same rows in fixed batches."""
    drawn_per_row = settings.temperature == 0 or settings.draw == "inverse_cdf"
    if not drawn_per_row or rows <= settings.batch_size or not takes_position_ids(model):
        return False
    model = model.get_base_model() if isinstance(model, PeftModel) else model
    return all(
        type(layer) is DynamicLayer for layer in DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    )


def decode_stream(
    model, rows: list[list[int]], settings: SamplingSpec, stops: list[int], pad_id: int, done=None
) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Completions of `rows` (prompt ids, admitted in this order: longest first keeps the middle narrow), at most
    `settings.batch_size` in the model's batch at a time, greedy or drawn by `decode.inverse_cdf`. Returns, per row,
    the ids up to and including its stop token (or `max_new_tokens` of them) and their log-probs under the
    distribution drawn from (temperature 1 when greedy) before and after truncation, as `decode.decode_batch` does.
    `done(k)` is called as k more rows finish (a progress bar)."""
    model = model.get_base_model() if isinstance(model, PeftModel) else model  # the model `generate` runs
    device, steps, width = next(model.parameters()).device, settings.max_new_tokens, settings.batch_size
    shared = shared_prefix(rows) if settings.share_prefix else 0
    prefix = torch.tensor(rows[0][:shared], device=device) if shared else None
    stop_ids, cache_arg = torch.tensor(stops, device=device), cache_name(model)
    process = warpers(settings)
    ids = torch.full((len(rows), steps), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((len(rows), steps), dtype=torch.float32, device=device)
    processed = torch.zeros_like(logprobs) if truncates(settings) else logprobs
    lengths = torch.zeros(len(rows), dtype=torch.long, device=device)
    waiting = deque(range(len(rows)))

    def admit(count: int):
        taken = [waiting.popleft() for _ in range(count)]
        return (
            torch.tensor(taken, device=device),
            *prefilled(model, [rows[r] for r in taken], shared, prefix, pad_id, device),
        )

    # live: the row of each place in the model's batch; running (over live): not finished; logits: running rows'.
    live, logits, cache, attention, positions = admit(min(width, len(waiting)))
    running = torch.ones(len(live), dtype=torch.bool, device=device)
    while True:
        rows_now = live[running]
        tokens, drawn_logprobs, drawn_processed = next_tokens(process, logits, rows_now, len(live), settings, pad_id)
        at = lengths[rows_now]
        ids[rows_now, at], logprobs[rows_now, at], processed[rows_now, at] = tokens, drawn_logprobs, drawn_processed
        lengths[rows_now] += 1
        ended = torch.isin(tokens, stop_ids) | (lengths[rows_now] == steps)
        running[running.clone()] = ~ended
        still = int(running.sum())  # the one host sync of a step
        if done is not None and still < len(rows_now):
            done(len(rows_now) - still)
        if still == 0 and not waiting:
            break
        # Finished rows are fed the pad token until compaction drops them, as decode_batch feeds them.
        feed = torch.full((len(live),), pad_id, device=device)
        feed[running] = tokens[~ended]
        attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=-1)
        positions = positions + 1
        compacted = len(live) - still >= max(1, COMPACT_SHARE * len(live))
        if compacted:
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, feed, attention, positions = live[keep], feed[keep], attention[keep], positions[keep]
            attention = trim(cache, attention, shared)  # the columns only the dropped rows attended
            running = torch.ones(len(live), dtype=torch.bool, device=device)
        if still:
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
        if compacted and waiting:  # the waiting rows take the places compaction freed
            new, new_logits, new_cache, new_attention, new_positions = admit(min(width - still, len(waiting)))
            if still == 0:
                live, logits, cache, attention, positions = new, new_logits, new_cache, new_attention, new_positions
            else:
                attention = trim(cache, join(cache, attention, new_cache, new_attention, shared), shared)
                live, logits = torch.cat([live, new]), torch.cat([logits, new_logits])
                positions = torch.cat([positions, new_positions])
            running = torch.ones(len(live), dtype=torch.bool, device=device)
    counts = lengths.tolist()
    return rows_of(ids, counts), rows_of(logprobs, counts), rows_of(processed, counts)


def prefilled(model, prompts: list[list[int]], shared: int, prefix: torch.Tensor | None, pad_id: int, device):
    """Prefill `prompts` (their distinct ones once, each after the `shared`-token `prefix` they all start with):
    (fp32 last logits [rows, vocab], cache, attention mask [rows, columns], position ids of the last token
    [rows, 1]). The mask is always given: the batch's rows join with padding columns between them."""
    distinct: dict[tuple[int, ...], int] = {}
    sources = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    rests = [list(p[shared:]) for p in distinct]
    longest = max(map(len, rests))
    input_ids = torch.tensor([[pad_id] * (longest - len(r)) + r for r in rests], device=device)
    attention = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rests], device=device)
    logits, cache, mask, positions = prefill_once(model, input_ids, attention, sources, prefix)
    if mask is None:  # no row padded: prefill_once passes no mask, as generate does
        mask = torch.ones((len(prompts), shared + longest), dtype=attention.dtype, device=device)
    return logits, cache, mask, positions


def join(
    cache: DynamicCache, attention: torch.Tensor, other: DynamicCache, other_attention: torch.Tensor, shared: int
) -> torch.Tensor:
    """Append `other`'s rows to `cache` (in place), the shorter side padded with masked zero columns after its
    first `shared` columns (the prefix both start with), so both end at the same right edge. Returns the joined
    attention mask."""
    gap = attention.shape[1] - other_attention.shape[1]
    if gap < 0:
        pad_middle(cache, -gap, shared)
        attention = widen(attention, -gap, shared)
    elif gap > 0:
        pad_middle(other, gap, shared)
        other_attention = widen(other_attention, gap, shared)
    for layer, extra in zip(cache.layers, other.layers):
        layer.keys = torch.cat([layer.keys, extra.keys])
        layer.values = torch.cat([layer.values, extra.values])
    return torch.cat([attention, other_attention])


def pad_middle(cache: DynamicCache, columns: int, shared: int) -> None:
    """`columns` zero columns inserted into every layer of `cache` after its first `shared` ones."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)
            zeros = states.new_zeros((*states.shape[:2], columns, states.shape[3]))
            setattr(layer, name, torch.cat([states[:, :, :shared], zeros, states[:, :, shared:]], dim=2))


def widen(attention: torch.Tensor, columns: int, shared: int) -> torch.Tensor:
    zeros = attention.new_zeros((attention.shape[0], columns))
    return torch.cat([attention[:, :shared], zeros, attention[:, shared:]], dim=1)


def trim(cache: DynamicCache, attention: torch.Tensor, shared: int) -> torch.Tensor:
    """Drop the columns after the prefix that no row attends (the rows they belonged to have left), from the
    cache in place and from the mask, which is returned."""
    used = attention[:, shared:].any(dim=0)
    first = int(used.int().argmax()) if bool(used.any()) else 0
    if first == 0:
        return attention
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[:, :, :shared], layer.keys[:, :, shared + first :]], dim=2)
        layer.values = torch.cat([layer.values[:, :, :shared], layer.values[:, :, shared + first :]], dim=2)
    return torch.cat([attention[:, :shared], attention[:, shared + first :]], dim=1)
