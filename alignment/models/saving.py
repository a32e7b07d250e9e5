"""Save a trained model as a plain Hugging Face checkpoint: LoRA merged into the weights (the adapter is kept
by the caller in `adapter/`), cast to the stage's save dtype, and read back so an empty tensor is an error
(docs/architecture.md, house rule 5: an empty checkpoint is never a success), and so is a tokenizer that
does not reload to the one the model was trained with (`tokenizer.check_round_trip`)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from safetensors import safe_open

from ..config.model import gguf_spec
from ..errors import UserError
from .gguf import convert_gguf
from .loading import (
    check_model_source,
    is_reward_adapter,
    load_policy,
    load_reward_model,
)
from .tokenizer import check_round_trip, load_tokenizer


def save_checkpoint(model, tokenizer, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    """Save a policy as merged weights, with the LoRA adapter (if any) in `adapter/` beside them; the merged
    weights in `dtype` when given (the stage's start checkpoint's own dtype: `checkpoint_dtype`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(model, PeftModel):
        model.save_pretrained(out_dir / "adapter")
        model = model.merge_and_unload()
    if dtype is not None and model.dtype != dtype:
        model = model.to(dtype)  # the stage is over: nothing trains on these weights any more
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    check_saved_tensors(out_dir)
    check_round_trip(tokenizer, out_dir)


def check_saved_tensors(out_dir: Path) -> None:
    """Read back every tensor written under `out_dir`: one with no elements is an error, never a finished stage.
    A model whose parameters are partitioned (ZeRO-3) or sharded and saved without gathering writes such tensors
    (shape [0]) and loads into nothing useful."""
    empty, files = [], sorted(Path(out_dir).rglob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            empty += [
                f"{path.relative_to(out_dir)}: {name}"
                for name in weights.keys()
                if 0 in weights.get_slice(name).get_shape()
            ]
    if not files:
        raise UserError(f"the checkpoint written to {out_dir} holds no weights files.")
    if empty:
        raise UserError(
            f"the checkpoint written to {out_dir} has {len(empty)} empty tensor(s) ({'; '.join(empty[:3])}"
            f"{', ...' if len(empty) > 3 else ''}): the weights were saved without being gathered from "
            "the processes that hold them. The stage is not marked finished."
        )


def export_plain_checkpoint(source: str, out: Path) -> str:
    """`align merge`: write `source` (an adapter folder, a stage output, or a .gguf file) to `out` as a plain
    checkpoint that loads without peft; returns what was written, for the user."""
    if gguf_spec(source) is not None:
        convert_gguf(gguf_spec(source).locate("merge source"), out)
        return f"plain checkpoint converted from {source} written to {out}"
    check_model_source(source, "merge source")
    # An adapter folder is merged into its base here; a reward model's stays a sequence classifier with its head.
    model = load_reward_model(source) if is_reward_adapter(source) else load_policy(source)
    tokenizer = load_tokenizer(source)
    if model.config.pad_token_id is None:  # a classifier's head finds the sequence end through the pad id
        model.config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    check_round_trip(tokenizer, out)
    return f"merged checkpoint written to {out}"
