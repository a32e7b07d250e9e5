"""LoRA through peft: the adapter config from a recipe's `lora:` spec, applying it, checking that its
`target_modules` exist in the model before training, and gradient checkpointing on a (peft) model."""

from __future__ import annotations

from accelerate import init_empty_weights
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
)

from ..config.model import LoraSpec
from ..errors import UserError
from .loading import adapter_base, is_adapter_dir


def peft_config(spec: LoraSpec, task_type: str = "CAUSAL_LM"):
    """peft LoraConfig; `task_type="SEQ_CLS"` keeps a reward model's fresh score head trainable."""
    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.target_modules,
        use_rslora=spec.use_rslora,
        task_type=task_type,
    )


def apply_lora(model, spec: LoraSpec, task_type: str = "CAUSAL_LM", adapter_name: str = "default"):
    try:
        return get_peft_model(model, peft_config(spec, task_type), adapter_name=adapter_name)
    except ValueError as error:
        raise UserError(
            f"lora: {str(error).strip().splitlines()[0]} (lora.target_modules = {spec.target_modules!r})"
        ) from None


def check_lora_targets(model_name: str, spec: LoraSpec, where: str, trust_remote_code: bool = False) -> None:
    """Apply the LoRA config to a weightless (meta-device) copy of the model, so that target modules
    that do not exist fail at `align check` rather than after the data is loaded."""
    source = adapter_base(model_name) if is_adapter_dir(model_name) else model_name
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    try:
        apply_lora(skeleton, spec)
    except UserError as error:
        raise UserError(f"{where}: {str(error).removeprefix('lora: ')}") from None


def enable_checkpointing(model, options: dict) -> None:
    """Gradient (activation) checkpointing on a transformers model, `options` going to
    torch.utils.checkpoint; under the method's name in this transformers (5.x renamed it)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
