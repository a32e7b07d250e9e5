"""Policy, reference and critic for the `ppo` stage, and how they are checkpointed.

With LoRA (the default) ONE copy of the base weights serves all three roles:
  policy    = base + LoRA adapter "default"  (peft saves the adapter named "default" at the top of
              `adapter/`, which is the storage convention of every policy stage; any other name
              would land in `adapter/<name>/`)
  reference = the same base with every adapter disabled (`with policy.disable_adapter():`)
  critic    = the same base + LoRA adapter "critic" + `value_head`, a Linear(hidden, 1) on the last
              hidden state (initialised from the reward model's score head when the sizes match)
With `lora: null` (full fine-tuning): the policy, a frozen deep copy as the reference, and a deep
copy of the policy's backbone + value head as the critic.

`ActorCritic.forward` runs the policy pass and then the critic pass on the same batch, so a single
forward/backward through the (DDP-)wrapped module trains both; the reference never enters the
wrapper (it is frozen, and DDP should not track it).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .models import apply_lora, enable_checkpointing, load_policy, peft_config
from .rl import entropy_from_logits, selective_log_softmax, sequence_logprobs

POLICY_ADAPTER = "default"
CRITIC_ADAPTER = "critic"


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as `generate` builds them, so left padding does not shift them (see rl.sequence_logprobs)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer body under the LM head (`model` for Qwen/Llama, `transformer` for GPT-2, ...)."""
    return getattr(causal_lm, causal_lm.base_model_prefix)


class ActorCritic(nn.Module):
    """The trainable part of PPO: policy + critic (+ value head). See the module docstring."""
    def __init__(self, policy: nn.Module, value_head: nn.Linear, critic_backbone: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.critic_backbone = critic_backbone  # None with LoRA: the critic is the shared base + critic adapter
        self._trainable = [p for p in self.parameters() if p.requires_grad]
        self.active_adapter = POLICY_ADAPTER
        self._checkpointed_layers: list[nn.Module] = []

    @property
    def is_lora(self) -> bool:
        return self.critic_backbone is None

    def use_adapter(self, name: str) -> None:
        """Activate one LoRA adapter. peft's `set_adapter` also freezes every other adapter, and a
        parameter frozen after the forward pass that used it gets no gradient, so we unfreeze again."""
        self.policy.base_model.set_adapter(name)
        self.active_adapter = name
        for param in self._trainable:
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
        self._checkpointed_layers = [m for model in models for m in model.modules()
                                     if isinstance(m, GradientCheckpointingLayer)]

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

    def forward(self, input_ids, attention_mask, num_logits_to_keep: int, temperature: float = 1.0,
                with_entropy: bool = False):
        """Log-probs [B, K] and values [B, K] of the last K tokens (+ entropy [B, K], detached, if asked).

        values[:, t] is read at the position that predicts completion token t (the state before it),
        the convention `rl.gae_advantages` expects.
        """
        k = int(num_logits_to_keep)
        self._flag_checkpointed_layers()
        positions = position_ids(attention_mask)
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          logits_to_keep=k + 1, use_cache=False)
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
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                              use_cache=False).last_hidden_state
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
        return [{"params": policy, "lr": learning_rate, "weight_decay": weight_decay},
                {"params": critic, "lr": critic_learning_rate, "weight_decay": weight_decay}]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable tensors only (adapters + value head with LoRA): what a resume checkpoint holds."""
        return {n: p.detach().cpu().clone() for n, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in state]
        unknown = [n for n in state if n not in params]
        if missing or unknown:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unknown[:3]}")
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)


@dataclass
class PPOModels:
    actor_critic: ActorCritic
    reference: nn.Module | None  # None with LoRA (the policy with adapters disabled)

    @property
    def policy(self) -> nn.Module:
        return self.actor_critic.policy

    @torch.no_grad()
    def reference_logprobs(self, input_ids, attention_mask, num_logits_to_keep: int, temperature: float,
                           batch_chunk_size: int | None = None) -> torch.Tensor:
        """Log-probs [B, K] of the last K tokens under the reference policy (the starting policy)."""
        if self.reference is not None:
            return sequence_logprobs(self.reference, input_ids, attention_mask, num_logits_to_keep, temperature,
                                     batch_chunk_size)
        try:
            with self.policy.disable_adapter():
                return sequence_logprobs(self.policy, input_ids, attention_mask, num_logits_to_keep, temperature,
                                         batch_chunk_size)
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


def build_models(policy_path: str, lora, reward_model: nn.Module | None = None,
                 trust_remote_code: bool = False) -> PPOModels:
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


def policy_for_saving(models: PPOModels) -> nn.Module:
    """The policy alone, ready for `models.save_checkpoint` (LoRA: the critic adapter is dropped)."""
    policy = models.policy
    if models.actor_critic.is_lora and CRITIC_ADAPTER in policy.peft_config:
        policy.base_model.set_adapter(POLICY_ADAPTER)
        policy.delete_adapter(CRITIC_ADAPTER)
    return policy
