"""TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, which the sft, dpo and rlvr trainers use) fitted to
a CPU: small tiles, and only the labelled positions scored.

Without Triton TRL folds each `[tokens, vocabulary]` tile of logits in plain torch, which makes about eight
temporaries of the tile's size, and its tiles are sized for a GPU (4096 tokens x 32768 vocabulary entries, fp32);
it also scores every position on such devices (prompts and padding included) to keep tile shapes fixed for
compilers. On a CPU nothing recompiles, so `fit_fused_head_to_cpu` scores only the positions whose label counts
(TRL's own path on a GPU) in tiles of `CPU_TOKEN_TILE` x `CPU_VOCAB_TILE`. Each position's log-sum-exp is the same
online fold over the vocabulary, so losses and gradients agree with TRL's defaults to float rounding.
Limits: it sets three private names of TRL (checked by tests/test_memory.py against the installed release) and
leaves them alone where one is missing or a GPU is present; it is process-wide and never undone.
"""

from __future__ import annotations

import importlib

import torch

CPU_TOKEN_TILE = 512  # positions a tile (a temporary: CPU_TOKEN_TILE x CPU_VOCAB_TILE fp32 values)
CPU_VOCAB_TILE = 8192


def _trl_modules():
    try:
        utils = importlib.import_module("trl.trainer.utils")
        kernels = importlib.import_module("trl.kernels.chunked_logprob")
    except ImportError:
        return None
    names = (
        (utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"),
        (utils, "_use_triton"),
        (kernels, "TOKEN_CHUNK_SIZE"),
    )
    return (utils, kernels) if all(hasattr(module, name) for module, name in names) else None


def _compact_where_no_triton(use_triton):
    """`add_fused_lm_head` asks `_use_triton(device)` only to decide whether to score the labelled positions alone;
    the kernels module keeps its own binding, which picks the Triton or the torch fold."""

    def compact(device: torch.device) -> bool:
        return use_triton(device) or device.type == "cpu"

    compact.fitted_to_cpu = True
    return compact


def fit_fused_head_to_cpu() -> bool:
    """Fit TRL's fused LM head to this CPU-only process (see the module docstring); True when it is (now) fitted."""
    if torch.cuda.is_available():
        return False
    modules = _trl_modules()
    if modules is None:
        return False
    utils, kernels = modules
    kernels.TOKEN_CHUNK_SIZE = min(kernels.TOKEN_CHUNK_SIZE, CPU_TOKEN_TILE)
    utils._CHUNKED_LOGPROB_CHUNK_SIZE = min(utils._CHUNKED_LOGPROB_CHUNK_SIZE, CPU_VOCAB_TILE)
    if not getattr(utils._use_triton, "fitted_to_cpu", False):
        utils._use_triton = _compact_where_no_triton(utils._use_triton)
    return True
