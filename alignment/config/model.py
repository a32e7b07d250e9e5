"""Model specs: the offline tiny from-scratch model and LoRA settings (loading is in `models.py`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

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


class TemplateSpec(Strict):
    """`template:` how prompts are rendered through the checkpoint's chat template. The settings are written
    into the tokenizer's template, so every stage renders with them and every output keeps them."""

    system_prompt: str | None = Field(None, description="system prompt for prompts that bring none, instead of the "
                                      "template's default (e.g. SmolLM2's, Qwen2.5's); '' for an empty one")
    kwargs: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="template variables, e.g. {enable_thinking: false} for Qwen3")

    @field_validator("kwargs")
    @classmethod
    def _names(cls, kwargs: dict) -> dict:
        for name in kwargs:
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise ValueError(f"template variable '{name}' is not a name")
        return kwargs

