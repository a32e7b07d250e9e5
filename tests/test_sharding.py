"""sharding.py and the checkpoint check in one process: a gathered state dict becomes a plain model that saves and
loads like the trained one (plain, LoRA, a reward model's LoRA with its score head, PPO's policy out of the
actor-critic), and a checkpoint with an empty tensor is an error. Under FSDP2 and ZeRO-3 the same code runs
with the state gathered from two processes: tests/test_distributed.py.

    python -m pytest tests/test_sharding.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import lora_policy
from safetensors.torch import load_file, save_file

from alignment.errors import UserError
from alignment.models.loading import load_policy
from alignment.models.saving import check_saved_tensors, save_checkpoint
from alignment.models.tokenizer import load_tokenizer
from alignment.training.sharding import save_trained, unsharded_copy


def outputs(model, ids=((5, 9, 12, 7),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_a_plain_copy_of_a_lora_model_computes_and_saves_the_same(tiny_model, tmp_path):
    model = lora_policy(tiny_model)
    untouched = copy.deepcopy(model)  # the copy shares the model's tensors, and saving merges LoRA into them
    clone = unsharded_copy(model, model.state_dict())
    assert torch.equal(outputs(clone), outputs(model))
    assert all(not p.is_meta for p in clone.parameters())
    head, embed = clone.get_base_model().lm_head.weight, clone.get_base_model().model.embed_tokens.weight
    assert head is embed  # tied again after filling
    tokenizer = load_tokenizer(str(tiny_model))
    save_checkpoint(clone, tokenizer, tmp_path / "copy")
    save_checkpoint(untouched, tokenizer, tmp_path / "direct")
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        ours, theirs = load_file(tmp_path / "copy" / name), load_file(tmp_path / "direct" / name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_state_that_does_not_fit_the_model_is_an_error(tiny_model):
    model = load_policy(str(tiny_model))
    state = {k: v for k, v in model.state_dict().items() if "layers.0.mlp" not in k}
    with pytest.raises(RuntimeError, match="missing .*layers.0.mlp"):
        unsharded_copy(model, state)


def test_save_trained_writes_what_the_reward_trainer_trained(tiny_model, tmp_path):
    """A reward model's LoRA (peft SEQ_CLS, the score head trained in full) through an Accelerator, as a stage
    saves it; one process, so the state is the model's own."""
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification

    from alignment.config.model import LoraSpec
    from alignment.models.loading import load_reward_model
    from alignment.models.lora import apply_lora
    from alignment.stages.reward import save_reward_model

    base = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    model = apply_lora(base, LoraSpec(r=4, lora_alpha=8), task_type="SEQ_CLS")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "score" in name:
                param.normal_(0, 0.05)
    expected = outputs(copy.deepcopy(model).merge_and_unload())
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(model)
    save_trained(accelerator, prepared, load_tokenizer(str(tiny_model)), tmp_path / "rm", save=save_reward_model)
    assert torch.allclose(outputs(load_reward_model(str(tmp_path / "rm"))), expected, atol=1e-6)


def test_ppo_saves_its_policy_without_the_critic(tiny_model):
    from alignment.config.model import LoraSpec
    from alignment.training.actor_critic import build_models, policy_state

    actor_critic = build_models(str(tiny_model), LoraSpec(r=4, lora_alpha=8)).actor_critic
    policy, state = policy_state(actor_critic, actor_critic.state_dict())
    assert not any("critic" in k or k.startswith("value_head") for k in state)
    clone = unsharded_copy(policy, state)
    assert list(clone.peft_config) == ["default"]
    assert torch.equal(outputs(clone), outputs(actor_critic.policy))


def test_a_checkpoint_with_an_empty_tensor_is_an_error(tmp_path):
    """What saving ZeRO-3 partitions without gathering them writes: tensors of shape [0]."""
    (tmp_path / "ok").mkdir()
    save_file({"a": torch.ones(2, 3), "scalar": torch.tensor(1.0)}, tmp_path / "ok" / "model.safetensors")
    check_saved_tensors(tmp_path / "ok")
    (tmp_path / "bad" / "adapter").mkdir(parents=True)
    save_file({"a": torch.ones(2, 3)}, tmp_path / "bad" / "model.safetensors")
    save_file(
        {"lora_A": torch.empty(0), "lora_B": torch.ones(1)}, tmp_path / "bad" / "adapter" / "adapter_model.safetensors"
    )
    with pytest.raises(
        UserError,
        match=r"1 empty tensor\(s\) \(adapter/adapter_model.safetensors: lora_A\).*not "
        r"marked finished",
    ):
        check_saved_tensors(tmp_path / "bad")
    (tmp_path / "none").mkdir()
    with pytest.raises(UserError, match="holds no weights files"):
        check_saved_tensors(tmp_path / "none")
