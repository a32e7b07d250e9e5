"""Model specs: the offline tiny from-scratch model and LoRA settings (loading is in `models.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class TinySpec(Strict):
    """A small from-scratch causal LM with a character-level tokenizer (offline runs and tests)."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(64, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int | None = None
    max_position_embeddings: int = 256


class LoraSpec(Strict):
    """peft LoRA settings; `target_modules: all-linear` adapts every linear layer but the output head."""

    r: int = Field(16, gt=0)
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    use_rslora: bool = False
