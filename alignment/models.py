"""Load tokenizers, policies and reward models; LoRA; the offline tiny-model builder; GGUF conversion.

How stage outputs store weights (see README "Checkpoints"): every policy stage writes *merged*
weights (a plain Hugging Face checkpoint any tool can load) plus, with LoRA, the adapter it trained
in `adapter/`. The next stage loads that checkpoint and trains a fresh adapter on top; its
reference policy is the same model with the adapter disabled, so no second copy of the weights is
held. `align merge` turns any adapter folder (ours or a peft one on a hub/local base) into a plain
merged checkpoint.

Security: `trust_remote_code` is off unless the recipe opts in, and weights load as safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from accelerate import init_empty_weights
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import is_gguf_available
from transformers.utils import logging as hf_logging

from .config.model import LoraSpec, TemplateSpec, TinySpec
from .dist import full_weights, get_logger
from .errors import UserError
from .formatting import end_of_turn, has_chat_template, marker_tokens, render_completion, render_prompt

log = get_logger(__name__)

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \n"
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def is_cuda() -> bool:
    return torch.cuda.is_available()


def default_dtype():
    """bf16 on a GPU that supports it, fp32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def build_tokenizer():
    """Character-level tokenizer with a chat template, pad and end-of-turn tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(spec: TinySpec, seed: int, path: Path) -> Path:
    """Write a deterministic random-init model + tokenizer to `path` (skipped when already there)."""
    if (path / "config.json").exists():
        return path

    tokenizer = build_tokenizer()
    config_class = Qwen2Config if spec.arch == "qwen2" else LlamaConfig
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for a 1 MB model is noise
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    hf_logging.enable_progress_bar()
    return path


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
        raise UserError(f"{path} already holds files that are not a conversion of a GGUF file; remove it or "
                        "convert into another folder.")
    if not gguf_available():
        raise UserError(f"model: reading the GGUF file {file} needs the `gguf` package, which is not installed: "
                        "pip install gguf (or pip install 'alignment-toolkit[gguf]').")
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


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").exists()


def check_model_source(name: str, where: str, trust_remote_code: bool = False) -> None:
    """Fail early when a model path/hub id cannot be resolved (exists locally, or in the hub cache)."""
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        raise UserError(f"{where}: '{name}' is a GGUF file, which is read as the recipe's top-level `model:` (converted "
                        "into output_dir/base), by `align eval` and by `align merge`; here give a checkpoint folder "
                        f"(`align merge {name} FOLDER` converts it into one).")
    if path.exists():
        if not ((path / "config.json").exists() or is_adapter_dir(path)):
            raise UserError(f"{where}: '{name}' exists but is not a model folder (no config.json or adapter_config.json).")
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


def load_tokenizer(name: str, trust_remote_code: bool = False, template: TemplateSpec | None = None):
    source = adapter_base(name) if is_adapter_dir(name) and not (Path(name) / "tokenizer_config.json").exists() else name
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None or tokenizer.pad_token in (tokenizer.eos_token, end_of_turn(tokenizer)):
        tokenizer.pad_token = spare_pad_token(tokenizer) or tokenizer.eos_token
    if template is not None:
        apply_template(tokenizer, template, name)
    return tokenizer


def jinja_literal(value) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    return json.dumps(value)


TEMPLATE_START, TEMPLATE_END = "{#- alignment template -#}", "{#- /alignment template -#}"


def apply_template(tokenizer, spec: TemplateSpec, name: str = "the model") -> None:
    """Write the recipe's `template:` into the tokenizer's chat template: the variables set first, then a
    system prompt put before conversations that bring none (the template's default then never shows). The
    settings sit between two markers, so a later stage replaces them rather than stacking a second copy."""
    if not has_chat_template(tokenizer):
        raise UserError(f"template: {name} has no chat template, so there is nothing to set; drop `template:` "
                        "(a model without one trains on plain prompt/completion or text rows).")
    template = tokenizer.chat_template
    if template.startswith(TEMPLATE_START) and TEMPLATE_END in template:
        template = template.split(TEMPLATE_END, 1)[1]
    head = "".join(f"{{%- set {k} = {jinja_literal(v)} %}}" for k, v in spec.kwargs.items())
    if spec.system_prompt is not None:
        head += ("{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = [{'role': 'system', "
                 f"'content': {json.dumps(spec.system_prompt)}}}] + messages %}}{{%- endif %}}")
    tokenizer.chat_template = TEMPLATE_START + head + TEMPLATE_END + template


def spare_pad_token(tokenizer) -> str | None:
    """A special token to pad with when a tokenizer has none (SmolLM2, Llama 3): one that never ends or
    shapes a turn. Padding with EOS, the usual choice, hides the end of every answer: a reward model's head
    reads the last token that is not padding, so `68<|im_end|>` would score as `68`, and a finished answer
    as a cut-off one. Names with "pad" first, then unk, then any other unused special token."""
    used = {tokenizer.eos_token, tokenizer.bos_token, end_of_turn(tokenizer)}
    if has_chat_template(tokenizer):
        try:
            probe = render_prompt(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except UserError:  # a template without a system role (Gemma 2)
            probe = render_prompt(tokenizer, "u")
        used |= {t for t in marker_tokens(tokenizer) if t in probe + render_completion(tokenizer, "u", "a")}
    def preference(token: str) -> tuple[int, str]:
        return (0 if "pad" in token.lower() else 1 if token == tokenizer.unk_token else 2), token

    return min(marker_tokens(tokenizer) - used - {None}, key=preference, default=None)


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
        base = AutoModelForCausalLM.from_pretrained(adapter_base(name), dtype=dtype, trust_remote_code=trust_remote_code)
        return PeftModel.from_pretrained(base, name).merge_and_unload()
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code,
                                                    use_safetensors=True)
    except OSError as error:
        raise UserError(f"could not load model '{name}': {str(error).strip().splitlines()[0]}") from None


def load_reward_model(name: str, trust_remote_code: bool = False, dtype=None):
    """A scalar-head sequence classifier (output of a `reward` stage, or any hub/local reward model); a reward
    adapter folder is merged into its base, score head included (peft keeps the trained head). Whole on every
    process: it scores, it is never wrapped by an engine."""
    with full_weights():
        return _load_reward_model(name, trust_remote_code, dtype)


def _load_reward_model(name: str, trust_remote_code: bool, dtype):
    if is_reward_adapter(name):
        base = AutoModelForSequenceClassification.from_pretrained(
            adapter_base(name), num_labels=1, dtype=dtype or default_dtype(), trust_remote_code=trust_remote_code)
        return PeftModel.from_pretrained(base, name).merge_and_unload().eval().requires_grad_(False)
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures) or config.num_labels != 1:
        raise UserError(
            f"'{name}' is not a reward model: its architecture is {architectures or 'unknown'} with "
            f"{config.num_labels} label(s); a reward model is a *ForSequenceClassification with one label "
            "(the output of a `reward` stage)."
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        name, dtype=dtype or default_dtype(), trust_remote_code=trust_remote_code, use_safetensors=True
    )
    model.eval().requires_grad_(False)
    return model


def peft_config(spec: LoraSpec, task_type: str = "CAUSAL_LM"):
    """peft LoraConfig; `task_type="SEQ_CLS"` keeps a reward model's fresh score head trainable."""
    return LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                      target_modules=spec.target_modules, use_rslora=spec.use_rslora, task_type=task_type)


def apply_lora(model, spec: LoraSpec, task_type: str = "CAUSAL_LM", adapter_name: str = "default"):
    try:
        return get_peft_model(model, peft_config(spec, task_type), adapter_name=adapter_name)
    except ValueError as error:
        raise UserError(f"lora: {str(error).strip().splitlines()[0]} (lora.target_modules = {spec.target_modules!r})") from None


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


def check_saved_tensors(out_dir: Path) -> None:
    """Read back every tensor written under `out_dir`: one with no elements is an error, never a finished stage.
    A model whose parameters are partitioned (ZeRO-3) or sharded and saved without gathering writes such tensors
    (shape [0]) and loads into nothing useful."""
    empty, files = [], sorted(Path(out_dir).rglob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            empty += [f"{path.relative_to(out_dir)}: {name}" for name in weights.keys()
                      if 0 in weights.get_slice(name).get_shape()]
    if not files:
        raise UserError(f"the checkpoint written to {out_dir} holds no weights files.")
    if empty:
        raise UserError(f"the checkpoint written to {out_dir} has {len(empty)} empty tensor(s) ({'; '.join(empty[:3])}"
                        f"{', ...' if len(empty) > 3 else ''}): the weights were saved without being gathered from "
                        "the processes that hold them. The stage is not marked finished.")


