"""GGUF checkpoints (`model: FILE.gguf`): converted once into a plain Hugging Face folder (transformers
dequantizes with the `gguf` package), which every stage then loads; the source file's size and mtime are kept
beside it so a changed file is converted again."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)
from transformers.utils import is_gguf_available
from transformers.utils import logging as hf_logging

from ..errors import UserError
from ..runtime.dist import get_logger

log = get_logger(__name__)


GGUF_SOURCE = "gguf_source.json"


def gguf_available() -> bool:
    return is_gguf_available()


def convert_gguf(file: Path, path: Path) -> Path:
    """Convert a GGUF file into a plain checkpoint at `path` (skipped when `path` already holds this file's
    conversion, per `gguf_source.json`: the file's path, size and modification time). transformers reads GGUF
    dequantized to fp32 but marks the model quantized, and such a model refuses `save_pretrained`; its
    weights, loaded into a model built from the same config without the quantization entry, save as a plain
    checkpoint. Tokenizer, chat template, generation config and EOS come from the file's metadata. A folder
    holding anything else is left alone (an error), not overwritten."""
    file = Path(file).resolve()
    source = {"file": str(file), "bytes": file.stat().st_size, "mtime_ns": file.stat().st_mtime_ns}
    marker = path / GGUF_SOURCE
    if (path / "config.json").exists() and marker.exists() and json.loads(marker.read_text()) == source:
        return path
    if path.exists() and any(path.iterdir()) and not marker.exists():  # never delete what we did not write
        raise UserError(
            f"{path} already holds files that are not a conversion of a GGUF file; remove it or "
            "convert into another folder."
        )
    if not gguf_available():
        raise UserError(
            f"model: reading the GGUF file {file} needs the `gguf` package, which is not installed: "
            "pip install gguf (or pip install 'alignment-toolkit[gguf]')."
        )
    log.info(f"converting {file.name} into a plain checkpoint at {path} (once; later runs reuse it)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except (ValueError, NotImplementedError, OSError) as error:
        raise UserError(f"model: could not read the GGUF file {file}: {str(error).strip().splitlines()[0]}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():  # parameters on the meta device: the loaded tensors are assigned, not copied
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(tmp, safe_serialization=True)
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    (tmp / GGUF_SOURCE).write_text(json.dumps(source, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
