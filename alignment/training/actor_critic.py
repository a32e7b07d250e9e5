"""Policy, reference and critic for the `ppo` stage, and how its loop is checkpointed.

With LoRA (the default) ONE copy of the base weights serves all three roles:
  policy    = base + LoRA adapter "default" (saved at the top of `adapter/`, as every policy stage saves)
  reference = the same base with every adapter disabled (`with policy.disable_adapter():`)
  critic    = the same base + LoRA adapter "critic" + `value_head`, a Linear(hidden, 1) on the last
              hidden state (initialised from the reward model's score head when the sizes match)
With `lora: null` (full fine-tuning): the policy, a frozen deep copy as the reference, and a deep
copy of the policy's backbone + value head as the critic.

`ActorCritic` (policy + critic) is the one module the engine (DDP, FSDP2, DeepSpeed) wraps and trains; the
reference never enters the wrapper. Loop checkpoints: `save_loop_state` / `load_loop_state`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..models.loading import load_policy
from ..models.lora import apply_lora, enable_checkpointing, peft_config
from ..rl import entropy_from_logits, selective_log_softmax, sequence_logprobs

POLICY_ADAPTER = "default"
CRITIC_ADAPTER = "critic"


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as `generate` builds them, so left padding does not shift them (see rl.sequence_logprobs)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer body under the LM head (`model` for Qwen/Llama, `transformer` for GPT-2, ...)."""
    return getattr(causal_lm, causal_lm.base_model_prefix)


class ActorCritic(nn.Module):
    """The trainable part of PPO: policy + critic (+ value head). See the module docstring.

    `forward` runs the policy pass and then the critic pass on the same batch, so a single forward/backward
    through the wrapped module (DDP, FSDP2, DeepSpeed) trains both; the reference stays outside (it is frozen,
    and the engine should not track it). Under FSDP2 and ZeRO-3 this module is what gets sharded; the
    reference copy (full fine-tuning) and the reward model stay whole on every process, loaded outside
    zero.Init (`models.load_policy`, `dist.full_weights`). peft saves the adapter named "default" at the top
    of `adapter/`; any other policy adapter name would land in `adapter/<name>/`.
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear, critic_backbone: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.critic_backbone = critic_backbone  # None with LoRA: the critic is the shared base + critic adapter
        # By name: FSDP2 replaces the parameter objects when it shards them.
        self._trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        self.active_adapter = POLICY_ADAPTER
        self._checkpointed_layers: list[nn.Module] = []

    @property
    def is_lora(self) -> bool:
        return self.critic_backbone is None

    @property
    def _no_split_modules(self) -> list[str]:
        """The policy's decoder-layer classes: FSDP2's transformer auto-wrap shards each such layer apart."""
        return list(getattr(self.policy, "_no_split_modules", None) or [])

    def tie_weights(self) -> None:
        """FSDP2's prepare re-ties embeddings through the root module it wraps, which is this one."""
        self.policy.tie_weights()

    def use_adapter(self, name: str) -> None:
        """Activate one LoRA adapter. peft's `set_adapter` also freezes every other adapter, and a
        parameter frozen after the forward pass that used it gets no gradient, so we unfreeze again."""
        self.policy.base_model.set_adapter(name)
        self.active_adapter = name
        for param_name, param in self.named_parameters():
            if param_name in self._trainable:
                param.requires_grad_(True)

    def enable_checkpointing(self) -> None:
        """Recompute each decoder layer in the backward pass instead of keeping its activations.

        Two things make this safe here. With LoRA the policy and critic passes run the same layers under
        different adapters, and the backward pass recomputes them under whichever adapter is active by then
        (measured: wrong critic gradients, silently); `context_fn` re-activates, for each recomputation,
        the adapter its forward pass ran with. And transformers checkpoints only layers in training mode,
        while PPO keeps its models in eval mode to keep dropout out of the ratio: the decoder layers alone
        are flagged as training, their attention and MLP children stay in eval mode.
        """
        options = {"use_reentrant": False}
        if self.is_lora:
            options["context_fn"] = self._recompute_under_forward_adapter
        models = [self.policy.get_base_model()] if self.is_lora else [self.policy, self.critic_backbone]
        for model in models:
            enable_checkpointing(model, options)
        self._checkpointed_layers = [
            m for model in models for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
        ]

    def _flag_checkpointed_layers(self) -> None:
        """Before every pass: sampling and evaluation call `eval()` on the policy itself, which clears the
        flag (a pass without gradients is not checkpointed either way)."""
        for layer in self._checkpointed_layers:
            layer.training = True

    def _recompute_under_forward_adapter(self):
        """torch.utils.checkpoint's context_fn: (context of the forward pass, context of its recomputation)."""
        adapter = self.active_adapter

        @contextlib.contextmanager
        def recompute():
            during_backward = self.active_adapter
            if during_backward == adapter:  # the policy pass: nothing to switch
                yield
                return
            self.use_adapter(adapter)
            try:
                yield
            finally:
                self.use_adapter(during_backward)

        return contextlib.nullcontext(), recompute()

    def forward(
        self, input_ids, attention_mask, num_logits_to_keep: int, temperature: float = 1.0, with_entropy: bool = False
    ):
        """Log-probs [B, K] and values [B, K] of the last K tokens (+ entropy [B, K], detached, if asked).

        values[:, t] is read at the position that predicts completion token t (the state before it),
        the convention `rl.gae_advantages` expects.
        """
        k = int(num_logits_to_keep)
        self._flag_checkpointed_layers()
        positions = position_ids(attention_mask)
        out = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            logits_to_keep=k + 1,
            use_cache=False,
        )
        logits = out.logits[:, -(k + 1) : -1]
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = selective_log_softmax(logits, input_ids[:, -k:])
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
        del out, logits
        return logprobs, self.values(input_ids, attention_mask, positions, k), entropy

    def values(self, input_ids, attention_mask, positions, k: int) -> torch.Tensor:
        if self.is_lora:
            self.use_adapter(CRITIC_ADAPTER)
            backbone = backbone_of(self.policy.get_base_model())
        else:
            backbone = self.critic_backbone
        try:
            hidden = backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
            ).last_hidden_state
        finally:
            if self.is_lora:
                self.use_adapter(POLICY_ADAPTER)
        hidden = hidden[:, -(k + 1) : -1]
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def param_groups(self, learning_rate: float, critic_learning_rate: float, weight_decay: float) -> list[dict]:
        """Optimizer groups: policy parameters and critic parameters (critic adapter/backbone + value head)."""
        critic, policy = [], []
        for name, param in self.named_parameters():
            if param.requires_grad:
                is_critic = name.startswith(("value_head.", "critic_backbone.")) or f".{CRITIC_ADAPTER}." in name
                (critic if is_critic else policy).append(param)
        return [
            {"params": policy, "lr": learning_rate, "weight_decay": weight_decay},
            {"params": critic, "lr": critic_learning_rate, "weight_decay": weight_decay},
        ]


@dataclass
class PPOModels:
    """What `build_models` returns: the actor-critic, and the reference as a full copy or (LoRA) None."""

    actor_critic: ActorCritic
    reference: nn.Module | None  # None with LoRA (the policy with adapters disabled)

    @property
    def policy(self) -> nn.Module:
        return self.actor_critic.policy

    @torch.no_grad()
    def reference_logprobs(
        self,
        input_ids,
        attention_mask,
        num_logits_to_keep: int,
        temperature: float,
        batch_chunk_size: int | None = None,
    ) -> torch.Tensor:
        """Log-probs [B, K] of the last K tokens under the reference policy (the starting policy)."""
        if self.reference is not None:
            return sequence_logprobs(
                self.reference, input_ids, attention_mask, num_logits_to_keep, temperature, batch_chunk_size
            )
        try:
            with self.policy.disable_adapter():
                return sequence_logprobs(
                    self.policy, input_ids, attention_mask, num_logits_to_keep, temperature, batch_chunk_size
                )
        finally:  # leaving `disable_adapter` re-activates the policy adapter and freezes the critic's
            self.actor_critic.use_adapter(POLICY_ADAPTER)


def value_head_for(hidden_size: int, reward_model: nn.Module | None) -> nn.Linear:
    """Linear(hidden, 1) in fp32; copies the reward model's score head when its input size matches,
    so the critic starts from the reward model's read-out (InstructGPT initialises the value
    function from the reward model); otherwise zeros (the critic first predicts 0 everywhere)."""
    head = nn.Linear(hidden_size, 1, dtype=torch.float32)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    score = getattr(reward_model, "score", None) if reward_model is not None else None
    if isinstance(score, nn.Linear) and tuple(score.weight.shape) == (1, hidden_size):
        with torch.no_grad():
            head.weight.copy_(score.weight.float())
            if score.bias is not None:
                head.bias.copy_(score.bias.float())
    return head


def build_models(
    policy_path: str, lora, reward_model: nn.Module | None = None, trust_remote_code: bool = False
) -> PPOModels:
    """Policy, reference and critic for `policy_path` (a merged checkpoint or adapter folder)."""
    base = load_policy(policy_path, trust_remote_code)
    hidden = base.config.get_text_config().hidden_size
    head = value_head_for(hidden, reward_model)
    if lora is None:
        reference = copy.deepcopy(base).eval().requires_grad_(False)
        critic_backbone = copy.deepcopy(backbone_of(base))
        return PPOModels(ActorCritic(base, head, critic_backbone), reference)
    policy = apply_lora(base, lora, adapter_name=POLICY_ADAPTER)
    policy.add_adapter(CRITIC_ADAPTER, peft_config(lora))
    policy.base_model.set_adapter(POLICY_ADAPTER)
    for name, param in policy.named_parameters():
        param.requires_grad_(f".{POLICY_ADAPTER}." in name or f".{CRITIC_ADAPTER}." in name)
    return PPOModels(ActorCritic(policy, head), None)


def policy_state(actor_critic: ActorCritic, state: dict) -> tuple[nn.Module, dict]:
    """The policy and its part of the actor-critic's gathered state (`sharding.save_trained`'s `pick`): the
    value head, the critic's backbone copy and the critic adapter are left out."""
    prefix, critic = "policy.", f".{CRITIC_ADAPTER}."
    policy = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix) and critic not in k}
    return actor_critic.policy, policy


def configure_deepspeed(accelerator, micro_batch_size: int, accumulation: int, max_grad_norm: float | None) -> None:
    """The DeepSpeed settings accelerate takes from a trainer's dataloader and arguments, which our loop has
    not: the micro-batch size, accumulation steps and gradient clipping (DeepSpeed clips in its step). Set
    before `prepare`, replacing whatever an earlier stage's trainer filled into the shared plugin."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config.update(
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=accumulation,
        train_batch_size=micro_batch_size * accumulation * accelerator.num_processes,
        gradient_clipping=max_grad_norm or 0.0,
    )


def checkpoints(work_dir: Path) -> list[Path]:
    """Complete loop checkpoints (`checkpoint-N`, never a `.tmp`), oldest first."""
    if not work_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in work_dir.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    return [p for _, p in sorted(found) if (p / "state.json").exists()]


def save_loop_state(accelerator, work_dir: Path, update: int, state: dict, files: dict | None = None) -> None:
    """`accelerator.save_state` (model, optimizer and what is registered for checkpointing: scheduler, KL
    controller; under FSDP2 and DeepSpeed every process writes its own shards), `state` as state.json and rank
    0's `files` ({name: object}, `torch.save`d), into `checkpoint-<update>.tmp`, which rank 0 renames when every
    process is done, then drops older ones."""
    tmp, final = work_dir / f"checkpoint-{update}.tmp", work_dir / f"checkpoint-{update}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=False)  # tied embeddings share storage: safetensors refuses
    accelerator.wait_for_everyone()  # every process has written its part (its RNG state at least)
    if accelerator.is_main_process:
        (tmp / "state.json").write_text(json.dumps(state))
        for name, value in (files or {}).items():
            torch.save(value, tmp / name)
        os.replace(tmp, final)
        for old in checkpoints(work_dir):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_loop_state(accelerator, work_dir: Path) -> tuple[dict | None, Path | None]:
    """Restore the newest complete checkpoint into the prepared objects; its state.json, or None."""
    found = checkpoints(work_dir)
    if not found:
        return None, None
    accelerator.load_state(str(found[-1]))
    return json.loads((found[-1] / "state.json").read_text()), found[-1]
