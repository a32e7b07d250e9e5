"""A prefix every row of a batch starts with, run once: the forward passes' side of the sampler's `share_prefix`.

Every prompt of a chat dataset starts with the same rendered system prompt (SmolLM2's default: 27 of the
arithmetic prompts' 46 tokens), so a batch that runs them all computes those tokens once per row. Here the
prefix runs once on one row, its KV cache is repeated for every row, and each row runs only its rest, laid out
[prefix, its own columns] with position ids counted over real tokens, so left padding inside the rest does not
shift them. The outputs equal the unshared forward's up to summation order (the prefix comes from a batch of
one): tests/test_prefix.py holds them to 1e-4 in log-prob on the test models.

Used by the sampler's prefill (`sampling.decode.prefill_once`), the evaluation's KL reference pass
(`after_prefix`, handed to `rl.sequence_logprobs` in the model's place) and reward-model scoring
(`training.scoring.score_ids`).
"""

from __future__ import annotations

import inspect

import torch
from peft import PeftModel
from transformers import DynamicCache

# A shared prefix shorter than this is run with each row: one more forward call costs more than it saves.
MIN_SHARED_PREFIX = 8


def shared_prefix(rows: list[list[int]]) -> int:
    """How many leading tokens all `rows` share, worth running once: 0 for a single row or fewer than
    MIN_SHARED_PREFIX; at most the shortest row's length - 1, so each row keeps a token of its own (whose logits
    start a prompt's decoding, or which a classifier's head reads)."""
    if len(rows) < 2:
        return 0
    shortest = min(map(len, rows))
    first = rows[0]
    length = next((i for i in range(shortest - 1) if any(r[i] != first[i] for r in rows)), shortest - 1)
    return length if length >= MIN_SHARED_PREFIX else 0


def cache_name(model) -> str:
    """The forward's name for the KV cache: `cache` in the newer transformers 5 releases (5.24 here),
    `past_key_values` before (the vLLM environment's transformers 5.19). A PEFT model's is its base model's."""
    model = model.get_base_model() if isinstance(model, PeftModel) else model
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def takes_position_ids(model) -> bool:
    """Whether the forward takes position ids (as `generate` decides whether to pass them). A shared prefix needs
    them: rows laid out [prefix, padding, rest] would otherwise count the padding as positions."""
    model = model.get_base_model() if isinstance(model, PeftModel) else model
    return "position_ids" in inspect.signature(model.forward).parameters


def takes_logits_to_keep(model) -> bool:
    """Whether the forward takes `logits_to_keep` (a causal LM's head on some positions only). A PEFT model passes
    it on to its base model, whose signature decides."""
    model = model.get_base_model() if isinstance(model, PeftModel) else model
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def prefix_cache(model, prefix: torch.Tensor, rows: int, cache: DynamicCache | None = None) -> DynamicCache:
    """The KV cache of `prefix` [P] run once (positions 0..P-1), repeated for `rows` rows, in `cache` (empty; by
    default a new `DynamicCache`; the sampler passes one that grows without copying, `sampling.kv_cache`). Only
    the keys and values are wanted: a causal LM is asked for the logits of no position (`logits_to_keep`, an empty
    index), so its head computes nothing. Asked for the last position's, as `generate` asks, torch's CPU linear
    would run that one-row strided slice of a frozen model as a product over a copy of the head's weight
    (`sampling.decode.contiguous_head_input`: slow in bf16, for logits thrown away); the keys and values are the
    same either way."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True)) if cache is None else cache
    none = {}  # the positions whose logits are kept: none
    if takes_logits_to_keep(model):
        none["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=prefix.device)
    model(
        input_ids=prefix[None],
        position_ids=torch.arange(prefix.shape[0], device=prefix.device)[None],
        use_cache=True,
        return_dict=True,
        **{cache_name(model): cache},
        **none,
    )
    cache.batch_repeat_interleave(rows)
    return cache


def forward_after_prefix(
    model, prefix: torch.Tensor | None, input_ids: torch.Tensor, attention: torch.Tensor, **kwargs
):
    """`model`'s output over rows [prefix, input_ids[r]] for a `prefix` [P] they all start with, the prefix run
    once (None or empty: the plain forward over `input_ids`, positions the model's own). `input_ids`, `attention`
    [B, L] are the rows without it (any padding); outputs cover those L columns only."""
    if prefix is None or prefix.numel() == 0:
        return model(input_ids=input_ids, attention_mask=attention, use_cache=False, **kwargs)
    shared = prefix.shape[0]
    cache = prefix_cache(model, prefix, input_ids.shape[0])
    full = torch.cat([attention.new_ones((input_ids.shape[0], shared)), attention], dim=-1)
    positions = (full.long().cumsum(-1) - 1).clamp(min=0)[:, shared:]
    return model(
        input_ids=input_ids,
        attention_mask=full,
        position_ids=positions,
        use_cache=True,
        **{cache_name(model): cache},
        **kwargs,
    )


def after_prefix(model, prefix: torch.Tensor | None):
    """A stand-in for `model` to pass where a forward is called as `model(input_ids=, attention_mask=, ...)` on
    rows that all start with `prefix` (left out of them): `forward_after_prefix`, which lays out the position ids
    itself (any given are dropped). `model` itself where there is no prefix."""
    if prefix is None or prefix.numel() == 0:
        return model

    def forward(input_ids, attention_mask, position_ids=None, use_cache=False, **kwargs):
        return forward_after_prefix(model, prefix, input_ids, attention_mask, **kwargs)

    return forward
