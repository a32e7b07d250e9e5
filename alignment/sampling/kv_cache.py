"""A KV cache that grows into reserved room instead of being copied at every decode step.

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies the layer's whole
cache at every step, a measurable share of a decode step's time, larger in bf16, where the matmuls are faster
(measured: docs/performance.md).
`ReservedLayer` keeps each layer's keys and values in a buffer with room for more positions and writes a step into
it; `keys` and `values` are views of the filled part, so every `DynamicLayer` method (`batch_select_indices`,
`batch_repeat_interleave`, `crop`) and the sampler's own edits (`stream.join`, `trim`, `pad_middle`), which read
and assign them, work unchanged. A tensor assigned to them becomes the new buffer, full; the next step then
reserves room again. Attention reads the same numbers in the same order, so the samples and log-probs are those
of the concatenating cache bit for bit (tests/test_sampling.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Room reserved when a layer is full: half its length again, at least MIN_ROOM positions. A 128-step decode
# after a 46-token prompt then copies its cache twice (at 78 and 118 positions) instead of at every step.
GROWTH = 0.5
MIN_ROOM = 32


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers [batch, heads, capacity, head_dim]. Each has its
    own filled length, as callers assign keys and values one after the other."""

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._lengths = [0, 0]
        super().__init__()

    def _view(self, which: int) -> torch.Tensor | None:
        buffer = self._buffers[which]
        return buffer if buffer is None or buffer.dim() != 4 else buffer[:, :, : self._lengths[which]]

    def _assign(self, which: int, tensor: torch.Tensor | None) -> None:
        self._buffers[which] = tensor
        self._lengths[which] = tensor.shape[-2] if tensor is not None and tensor.dim() == 4 else 0

    keys = property(lambda self: self._view(0), lambda self, t: self._assign(0, t))
    values = property(lambda self: self._view(1), lambda self, t: self._assign(1, t))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self._buffers[0] is None or self._buffers[0].dim() != 4:
            self.lazy_initialization(key_states, value_states)
            self._grow(key_states, value_states)
        elif self._lengths[0] + key_states.shape[-2] > self._buffers[0].shape[-2]:
            self._grow(key_states, value_states)
        start = self._lengths[0]
        end = start + key_states.shape[-2]
        self._buffers[0][:, :, start:end] = key_states
        self._buffers[1][:, :, start:end] = value_states
        self._lengths = [end, end]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers with room for `key_states` and GROWTH more, the filled part copied over."""
        filled = self._lengths[0]
        need = filled + key_states.shape[-2]
        capacity = need + max(MIN_ROOM, int(need * GROWTH))
        grown = []
        for old, states in zip(self._buffers, (key_states, value_states)):
            buffer = states.new_empty((*states.shape[:2], capacity, states.shape[3]))
            if filled:
                buffer[:, :, :filled] = old[:, :, :filled]
            grown.append(buffer)
        self._buffers = grown


def reserved_cache(model) -> DynamicCache:
    """A `DynamicCache` for `model` whose plain layers are `ReservedLayer`s (sliding-window and other layer kinds
    are kept as transformers makes them)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    cache.layers = [ReservedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
