"""Whether a training stage needs gradient checkpointing to fit on its GPU, estimated before it trains.

Gradient checkpointing keeps only each decoder layer's input for the backward pass and recomputes the
rest: one more forward pass per step for most of the activation memory. TRL turns it on always; we turn it
on only when the estimate (`peak_bytes`: weights, optimizer state, activations and logits per process and
optimizer step, from the model's config and the step's batch and lengths) says the stage would not fit
without it. `train: {gradient_checkpointing: ...}` in the recipe always wins; CPU runs never get it
(there it only costs time). Callers: `StageContext.trl_args` (TRL stages) and `PPOLoop` (ppo, with
`ActorCritic.enable_checkpointing`).

Limits: what a layer saves for backward is counted for Llama/Qwen-style decoder layers (tests/test_memory.py);
a layer that saves more is underestimated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..models.loading import adapter_base, is_adapter_dir
from ..runtime.dist import get_logger

log = get_logger(__name__)

GIB = 2**30
USABLE_FRACTION = 0.85  # of the free GPU memory: the allocator's fragmentation and the CUDA context need the rest
FP32 = 4
LOGIT_COPIES_FP32 = 3  # fp32 upcast for the loss, its log-softmax, the gradient of the logits


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a Hugging Face config (any decoder-only transformer)."""

    parameters: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config, trust_remote_code: bool = False) -> ModelShape:
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
        return cls(
            parameters=count_parameters(config, trust_remote_code),
            hidden=hidden,
            intermediate=intermediate,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
        )

    def layer_activation_bytes(self, dtype_bytes: int) -> int:
        """Bytes one decoder layer saves for backward per token (`peak_bytes` lists them)."""
        kv = self.kv_heads * self.head_dim
        norms = 2 * (FP32 * self.hidden + 2 * dtype_bytes * self.hidden + FP32)
        attention = dtype_bytes * (2 * self.heads * self.head_dim + 2 * kv) + FP32 * self.heads
        mlp = 4 * dtype_bytes * self.intermediate
        return norms + attention + mlp

    def lora_parameters(self, rank: int) -> int:
        """Adapter parameters with LoRA on every linear layer (`target_modules: all-linear`)."""
        kv = self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        per_layer = (self.hidden + q) * 2 + (self.hidden + kv) * 2 + 3 * (self.hidden + self.intermediate)
        return rank * per_layer * self.layers


def count_parameters(config, trust_remote_code: bool = False) -> int:
    """Exact parameter count, from a model built on the meta device (no memory, no weights read)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class StepShape:
    """One process's share of one optimizer step's forward pass."""

    sequences: int
    length: int
    vocab_logits: bool = True  # False for a reward model: one score per sequence, no vocabulary projection
    reference_copy: bool = False
    lora_rank: int | None = None
    critic: bool = False  # ppo: a second pass (the critic) over the same tokens, with its own trainable weights
    logit_length: int | None = None  # positions that get logits (ppo: the completion only); None: all

    @property
    def tokens(self) -> int:
        return self.sequences * self.length

    @property
    def logit_tokens(self) -> int:
        return self.sequences * (self.logit_length or self.length) if self.vocab_logits else 0


def step_shape(kind: str, args, lora_rank: int | None) -> StepShape:
    """The step a TRL config describes: pairs count twice (chosen and rejected run together); GRPO/RLOO
    prompts are not cut by the config, so a prompt is taken to be as long as the completion limit."""
    batch = args.per_device_train_batch_size
    full = lora_rank is None
    if kind == "dpo":
        return StepShape(
            2 * batch, args.max_length, reference_copy=full and not args.precompute_ref_log_probs, lora_rank=lora_rank
        )
    if kind == "reward":
        return StepShape(2 * batch, args.max_length, vocab_logits=False, lora_rank=lora_rank)
    if kind == "rlvr":
        return StepShape(
            batch,
            2 * args.max_completion_length,
            reference_copy=full and getattr(args, "beta", 0) > 0,
            lora_rank=lora_rank,
        )
    return StepShape(batch, args.max_length, lora_rank=lora_rank)  # sft, rsft


def peak_bytes(model: ModelShape, step: StepShape, dtype_bytes: int, checkpointing: bool) -> int:
    """Peak bytes of one process's optimizer step, per term:

        weights            parameters x bytes per parameter (+ a reference copy: full-weight DPO without
                           precomputed reference log-probs, full-weight GRPO/RLOO with a KL term; full-weight
                           PPO holds policy, reference and critic)
        optimizer          trainable parameters x 3 (gradient + AdamW's two moments, in the weights' dtype);
                           PPO trains a critic beside the policy
        activations        tokens x layers x what one decoder layer saves for backward (below);
                           with checkpointing: tokens x layers x one hidden state, plus one layer in full;
                           PPO's policy and critic passes both wait for the one backward pass
        logits             tokens x vocabulary x (dtype + 12) bytes: the logits, their fp32 copy for the
                           loss, its log-softmax and their gradient (checkpointing does not shrink these);
                           PPO computes them for the completion only

    What one decoder layer of a Llama/Qwen-style model saves for backward, per token (counted with
    autograd's saved-tensor hooks, tests/test_memory.py; docs/performance.md has the 0.5B figures):
    two RMSNorms keep their input upcast to fp32 (4 x hidden bytes each) and two hidden-sized tensors in
    the model's dtype; attention keeps q, its output and k, v (key/value heads) and the rotary cos/sin;
    the MLP keeps its gate, up, activation and product (4 x intermediate)."""
    full = step.lora_rank is None
    passes = 2 if step.critic else 1
    copies = 1 + step.reference_copy + (step.critic and full)  # full-weight ppo: policy, reference, critic
    weights = model.parameters * dtype_bytes * copies
    trainable = model.parameters if full else model.lora_parameters(step.lora_rank)
    optimizer = trainable * passes * dtype_bytes * 3
    layer = model.layer_activation_bytes(dtype_bytes)
    if checkpointing:
        activations = step.tokens * (passes * model.layers * model.hidden * dtype_bytes + layer)
    else:
        activations = step.tokens * passes * model.layers * layer
    logits = step.logit_tokens * model.vocab * (dtype_bytes + LOGIT_COPIES_FP32 * FP32)
    return weights + optimizer + activations + logits


@dataclass(frozen=True)
class Plan:
    checkpointing: bool
    without: int  # estimated peak bytes without gradient checkpointing
    with_: int
    available: int

    def describe(self) -> str:
        verdict = "on" if self.checkpointing else "off"
        return (
            f"gradient checkpointing {verdict}: estimated peak {readable(self.without)} without it, "
            f"{readable(self.with_)} with it, {readable(self.available)} usable on this GPU "
            "(set train.gradient_checkpointing to choose)"
        )


def readable(size: int) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


def plan(model: ModelShape, step: StepShape, dtype_bytes: int, available: int) -> Plan:
    """Checkpointing exactly when the stage would not fit without it."""
    without = peak_bytes(model, step, dtype_bytes, checkpointing=False)
    with_ = peak_bytes(model, step, dtype_bytes, checkpointing=True)
    return Plan(checkpointing=without > available, without=without, with_=with_, available=available)


def usable_gpu_bytes() -> int | None:
    """USABLE_FRACTION of this process's GPU's free memory; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free * USABLE_FRACTION)


def model_shape(model_name: str, trust_remote_code: bool) -> ModelShape | None:
    """The shape of a local or cached model (an adapter folder: its base); None when it cannot be read yet,
    e.g. `align check` before the stage that writes it has run."""
    try:
        name = adapter_base(model_name) if is_adapter_dir(model_name) else model_name
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        return ModelShape.from_config(config, trust_remote_code)
    except Exception:  # noqa: BLE001 - an estimate must not stop a run; without it checkpointing stays off
        return None


def needs_checkpointing(
    model_name: str, step_of: Callable[[], StepShape], dtype_bytes: int, trust_remote_code: bool, where: str
) -> bool:
    """True when the step `step_of()` describes would not fit on this process's GPU without gradient
    checkpointing (the decision is printed); False on CPU, without calling `step_of` (ppo tokenizes every
    prompt for it), and (said so) when the model's shape cannot be read."""
    available = usable_gpu_bytes()
    if available is None:
        return False
    model = model_shape(model_name, trust_remote_code)  # every process decides for its own GPU; rank 0 says so
    if model is None:
        log.info(
            f"[{where}] gradient checkpointing off: could not read the shape of {model_name} to estimate the "
            "memory this stage needs; set train.gradient_checkpointing: true if it does not fit"
        )
        return False
    decision = plan(model, step_of(), dtype_bytes, available)
    log.info(f"[{where}] {decision.describe()}")
    return decision.checkpointing


def needs_gradient_checkpointing(
    args, kind: str, model_name: str, lora_rank: int | None, trust_remote_code: bool, where: str
) -> bool:
    """`needs_checkpointing` for the stage a TRL config describes."""
    dtype_bytes = 2 if (args.bf16 or args.fp16) else FP32
    return needs_checkpointing(
        model_name, lambda: step_shape(kind, args, lora_rank), dtype_bytes, trust_remote_code, where
    )
