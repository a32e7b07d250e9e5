"""Load policies and reward models (hub id, local folder, or one of our adapter folders), and check that a
model source resolves before anything trains.

How stage outputs store weights (README "Checkpoints"): every policy stage writes *merged* weights (a plain
Hugging Face checkpoint any tool can load) plus, with LoRA, the adapter it trained in `adapter/`. The next
stage loads that checkpoint and trains a fresh adapter on top; its reference policy is the same model with the
adapter disabled, so no second copy of the weights is held.

Security: `trust_remote_code` is off unless the recipe opts in, and weights load as safetensors.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from ..errors import UserError
from ..runtime.dist import full_weights
from .implicit_reward import ImplicitRewardModel, is_implicit_reward_model, read_marker
from .reward_ensemble import RewardEnsemble, is_reward_ensemble, read_standardisation
from .reward_ensemble import read_marker as read_ensemble


def is_cuda() -> bool:
    return torch.cuda.is_available()


def default_dtype():
    """bf16 on a GPU that supports it, fp32 elsewhere: training in bf16 on a CPU loses precision, and a CPU without
    AMX or AVX512-BF16 multiplies bf16 slowly. Sampling can still run on a bf16 copy (`dtype: bfloat16`)."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").exists()


def check_model_source(name: str, where: str, trust_remote_code: bool = False) -> None:
    """Fail early when a model path/hub id cannot be resolved (exists locally, or in the hub cache)."""
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        raise UserError(
            f"{where}: '{name}' is a GGUF file, which is read as the recipe's top-level `model:` (converted "
            "into output_dir/base), by `align eval` and by `align merge`; here give a checkpoint folder "
            f"(`align merge {name} FOLDER` converts it into one)."
        )
    if path.exists():
        if not ((path / "config.json").exists() or is_adapter_dir(path)):
            raise UserError(
                f"{where}: '{name}' exists but is not a model folder (no config.json or adapter_config.json)."
            )
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{where}: model path '{name}' does not exist.")

    try:
        AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise UserError(
            f"{where}: model '{name}' is neither a local folder nor loadable from the Hugging Face Hub or its "
            f"cache ({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}). "
            "Without network access, download it beforehand or give a local path."
        ) from None


def checkpoint_dtype(name: str, trust_remote_code: bool = False) -> torch.dtype | None:
    """The dtype a checkpoint stores its weights in (config.json's `dtype`; an adapter's: its base's), or None
    when it says none. Training loads weights in `default_dtype()`; outputs are saved back in this one."""
    source = adapter_base(name) if is_adapter_dir(name) else name
    try:
        stored = getattr(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code), "dtype", None)
    except (OSError, ValueError):
        return None
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    return stored if isinstance(stored, torch.dtype) else None


def adapter_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "adapter_config.json").read_text())


def adapter_base(path: str | Path) -> str:
    return adapter_config(path)["base_model_name_or_path"]


def is_reward_adapter(path: str | Path) -> bool:
    """An adapter trained on a sequence classifier (the `reward` stage's `adapter/`): peft task SEQ_CLS."""
    return is_adapter_dir(path) and adapter_config(path).get("task_type") == "SEQ_CLS"


def load_policy(name: str, trust_remote_code: bool = False, dtype=None, partitioned: bool = False):
    """A causal LM from a folder, hub id or adapter folder (adapter merged into its base). Whole on every process
    (`dist.full_weights`), unless `partitioned`: a model a trainer is about to wrap, which under ZeRO-3 loads into
    its partitions (zero.Init) and under FSDP's CPU-RAM-efficient loading may leave parts on the meta device
    off rank 0 (`dist.loads_partitioned`)."""
    with contextlib.nullcontext() if partitioned else full_weights():
        return _load_policy(name, trust_remote_code, dtype or default_dtype())


def _load_policy(name: str, trust_remote_code: bool, dtype):
    if is_adapter_dir(name):
        base = AutoModelForCausalLM.from_pretrained(
            adapter_base(name), dtype=dtype, trust_remote_code=trust_remote_code
        )
        return PeftModel.from_pretrained(base, name).merge_and_unload()
    try:
        return AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    except OSError as error:
        raise UserError(f"could not load model '{name}': {str(error).strip().splitlines()[0]}") from None


def is_reward_classifier(config) -> bool:
    """Whether a checkpoint's config is a reward model's: a *ForSequenceClassification with one label."""
    architectures = getattr(config, "architectures", None) or []
    return any(a.endswith("ForSequenceClassification") for a in architectures) and config.num_labels == 1


def load_reward_model(name: str, trust_remote_code: bool = False, dtype=None):
    """A scalar-head sequence classifier (output of a `reward` stage, or any hub/local reward model); a reward
    adapter folder is merged into its base, score head included (peft keeps the trained head); or a `dpo`
    stage's output read as its implicit reward (`implicit_reward.ImplicitRewardModel`: the policy and the
    reference it names); or a reward stage's ensemble (`reward_ensemble.RewardEnsemble`: every member). Whole on
    every process: it scores, it is never wrapped by an engine."""
    if is_reward_ensemble(name):
        members, combine, penalty = read_ensemble(name)
        with full_weights():
            return RewardEnsemble(
                [_load_reward_model(m, trust_remote_code, dtype) for m in members],
                combine,
                penalty,
                read_standardisation(name, len(members)),
            )
    if is_implicit_reward_model(name):
        reference, beta = read_marker(name)
        return ImplicitRewardModel(
            load_policy(name, trust_remote_code, dtype), load_policy(reference, trust_remote_code, dtype), beta
        )
    with full_weights():
        return _load_reward_model(name, trust_remote_code, dtype)


def _load_reward_model(name: str, trust_remote_code: bool, dtype):
    if is_reward_adapter(name):
        base = AutoModelForSequenceClassification.from_pretrained(
            adapter_base(name), num_labels=1, dtype=dtype or default_dtype(), trust_remote_code=trust_remote_code
        )
        return PeftModel.from_pretrained(base, name).merge_and_unload().eval().requires_grad_(False)
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    architectures = getattr(config, "architectures", None) or []
    if not is_reward_classifier(config):
        raise UserError(
            f"'{name}' is not a reward model: its architecture is {architectures or 'unknown'} with "
            f"{config.num_labels} label(s); a reward model is a *ForSequenceClassification with one label "
            "(the output of a `reward` stage), or a `dpo` stage's output, read as its implicit reward."
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        name, dtype=dtype or default_dtype(), trust_remote_code=trust_remote_code, use_safetensors=True
    )
    model.eval().requires_grad_(False)
    return model
