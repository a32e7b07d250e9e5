"""Helpers shared by several test modules (tests import them as `from helpers import ...`; fixtures and
recipe/CLI helpers live in conftest.py). Test modules never import each other."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import torch
from conftest import write_recipe

BREVITY = "def brevity(completion):\n    return -len(completion) / 8.0\n"


def tiny_ppo_recipe(folder: Path, policy: Path, **ppo) -> Path:
    """A fast PPO recipe on a tiny model whose reward is a verifier next to the recipe (shorter = better)."""
    (folder / "my_rewards.py").parent.mkdir(parents=True, exist_ok=True)
    (folder / "my_rewards.py").write_text(BREVITY)
    stage = {
        "policy": str(policy),
        "verifiers": [{"name": "my_rewards:brevity"}],
        "data": {"task": "arithmetic", "split": "train", "n": 64},
        "rollout": {"batch_size": 8, "max_new_tokens": 6},
        "train": {
            "total_updates": 3,
            "mini_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "ppo_epochs": 1,
            "learning_rate": 5.0e-3,
            "save_every": 100,
        },
    }
    for key, value in ppo.items():
        stage[key] = {**stage[key], **value} if isinstance(value, dict) and key in stage else value
    recipe = {
        "name": "ppo-tiny",
        "model": str(policy),
        "output_dir": str(folder / "out"),
        "seed": 3,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": {"ppo": stage},
    }
    return write_recipe(folder, recipe)


def trainable_digest(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def lora_policy(tiny_model):
    """The tiny model with a non-zero LoRA adapter, so the adapter really changes the outputs."""
    from alignment.config.model import LoraSpec
    from alignment.models.loading import load_policy
    from alignment.models.lora import apply_lora

    model = apply_lora(load_policy(str(tiny_model)), LoraSpec(r=4, lora_alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}


def completion_logprob(model, tokenizer, prompt: str, completion: str) -> torch.Tensor:
    """log p(completion | prompt): plain forward pass, log-softmax, sum over the completion's tokens. The
    rendered prompt already holds every special token, so none is added (as the stages encode it)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[len(prompt_ids) - 1 :].sum()


def pairwise_accuracy(reward_model, tokenizer, pairs: list[dict], batch_size: int = 16) -> dict[str, float]:
    """Share of pairs where the chosen answer outscores the rejected one, and the mean score margin."""
    from alignment.training.scoring import score_texts

    prompts = [p["prompt"] for p in pairs]
    chosen = score_texts(reward_model, tokenizer, prompts, [p["chosen"] for p in pairs], batch_size)
    rejected = score_texts(reward_model, tokenizer, prompts, [p["rejected"] for p in pairs], batch_size)
    margins = [c - r for c, r in zip(chosen, rejected)]
    return {"accuracy": sum(m > 0 for m in margins) / len(margins), "margin": sum(margins) / len(margins)}


def count_parameter_storage(*modules) -> int:
    """Bytes of distinct parameter storage across modules (shared tensors counted once)."""
    seen, total = set(), 0
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += tensor.untyped_storage().nbytes()
    return total


# Every sampling field transformers reads from a checkpoint's generation_config.json, each set to a value
# that visibly changes what is sampled (collapsed distributions, forced lengths, banned tokens, beams).
SKEWED_GENERATION = {
    "do_sample": True,
    "temperature": 0.2,
    "top_k": 2,
    "top_p": 0.3,
    "min_p": 0.99,
    "typical_p": 0.2,
    "epsilon_cutoff": 0.2,
    "eta_cutoff": 0.2,
    "repetition_penalty": 3.0,
    "encoder_repetition_penalty": 2.0,
    "no_repeat_ngram_size": 1,
    "min_new_tokens": 5,
    "min_length": 30,
    "max_new_tokens": 2,
    "max_length": 40,
    "num_beams": 2,
    "length_penalty": 2.0,
    "bad_words_ids": [[5], [6]],
    "suppress_tokens": [7, 8],
    "begin_suppress_tokens": [9],
    "exponential_decay_length_penalty": [2, 1.5],
    "renormalize_logits": True,
    "top_h": 0.5,
    "num_return_sequences": 2,
    "sequence_bias": [[[5], 4.0]],
    "forced_bos_token_id": 10,
    "forced_eos_token_id": 11,
    "max_time": 0.001,
}


def with_skewed_generation_config(model_dir: Path, folder: Path, extra_eos: int | None = None) -> Path:
    """A copy of a checkpoint whose generation_config.json sets every sampling field (SKEWED_GENERATION),
    and optionally lists a second EOS id, as Qwen2.5-Instruct's does."""
    import shutil

    copy = folder / "skewed"
    shutil.copytree(model_dir, copy)
    config = (
        json.loads((copy / "generation_config.json").read_text()) if (copy / "generation_config.json").exists() else {}
    )
    config.update(SKEWED_GENERATION)
    if extra_eos is not None:
        eos = config.get("eos_token_id")
        config["eos_token_id"] = [*([] if eos is None else [eos] if isinstance(eos, int) else eos), extra_eos]
    (copy / "generation_config.json").write_text(json.dumps(config))
    return copy


def without_pad_token(model_dir: Path, folder: Path) -> Path:
    """A copy of a checkpoint whose tokenizer has no pad token, as SmolLM2's and Llama 3's ship."""
    import shutil

    copy = folder / "no-pad"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_gguf(
    path: Path, seed: int = 0, hidden: int = 16, heads: int = 2, kv_heads: int = 1, ffn: int = 32
) -> Path:
    """A one-layer Llama in GGUF (fp32 tensors) with a byte-level BPE tokenizer, ChatML special tokens (EOS and
    pad <|im_end|>, as SmolLM2 ships) and a ChatML chat template, written with the `gguf` package's writer."""
    import gguf
    import numpy as np
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(ByteLevel.alphabet()) + ["Ġt", "Ġa"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    for add, value in [
        (writer.add_block_count, 1),
        (writer.add_context_length, 256),
        (writer.add_embedding_length, hidden),
        (writer.add_feed_forward_length, ffn),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_rope_freq_base, 10000.0),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_vocab_size, len(tokens)),
        (writer.add_rope_dimension_count, hidden // heads),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "default"),
        (writer.add_token_list, tokens),
        (writer.add_token_types, [3] * len(specials) + [1] * (len(tokens) - len(specials))),
        (writer.add_token_merges, ["Ġ t", "Ġ a"]),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
        (writer.add_unk_token_id, 0),
        (writer.add_pad_token_id, 2),
        (writer.add_add_bos_token, False),
        (writer.add_chat_template, CHATML),
    ]:
        add(value)
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    head = hidden // heads
    weight("token_embd.weight", len(tokens), hidden)
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(hidden, np.float32))
    for name, shape in [
        ("attn_q", (hidden, hidden)),
        ("attn_k", (kv_heads * head, hidden)),
        ("attn_v", (kv_heads * head, hidden)),
        ("attn_output", (hidden, hidden)),
        ("ffn_gate", (ffn, hidden)),
        ("ffn_up", (ffn, hidden)),
        ("ffn_down", (hidden, ffn)),
    ]:
        weight(f"blk.0.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patch_everywhere(monkeypatch, module, name: str, new) -> None:
    """Replace `module.name` in every loaded module of ours that imported it by name (`from x import name` binds
    it in the importer, so patching the defining module alone would miss the stages that call it)."""
    import sys

    original = getattr(module, name)
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("alignment") and getattr(loaded, name, None) is original:
            monkeypatch.setattr(loaded, name, new)


# --- multi-turn tool rollouts on a real sampler (tests/test_tools.py, tests/test_vllm_engine.py, tests/vllm_cpu) ---
ONE_PLUS_ONE = "2"  # what calculator("1+1") returns: the one tool result of `calculator_rollout`


def quick_stopping(model_path: Path, folder: Path) -> Path:
    """A copy of the tiny checkpoint whose generation_config.json also lists the lowercase letters as EOS ids, so
    that a random model ends most turns within a few tokens (both samplers stop at every EOS id it lists)."""
    shutil.copytree(model_path, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]  # the character tokenizer's
    config["eos_token_id"] = [config["eos_token_id"], *(vocab[c] for c in string.ascii_lowercase)]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def calculator_rollout(
    model, tokenizer, settings, monkeypatch, prompts: list[str], max_turns: int = 3, max_completion_length: int = 200
):
    """A hermes rollout with the calculator where every closed turn is read as a call of 1+1, so rollouts run
    several turns with tool results between them. Returns the trajectories and every text the tokenizer encoded
    while they ran (the prompts are encoded before)."""
    from alignment.config.tools import ToolSpec
    from alignment.tools.formats import Call, ToolFormat
    from alignment.tools.registry import resolve_tools
    from alignment.tools.rollout import RolloutLimits, rollout, start

    fmt = ToolFormat("hermes", native=False)
    monkeypatch.setattr(ToolFormat, "parse", lambda self, text: ([Call("calculator", {"expression": "1+1"})], []))
    trajectories = start(
        tokenizer,
        fmt,
        resolve_tools([ToolSpec(name="calculator")], None, []),
        prompts,
        [{}] * len(prompts),
        describe=False,
    )
    encoded: list[str] = []
    tokenize = type(tokenizer).__call__

    def recorded(self, text, *args, **kwargs):
        encoded.append(text)
        return tokenize(self, text, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(type(tokenizer), "__call__", recorded)
        rollout(model, tokenizer, trajectories, fmt, settings, RolloutLimits(max_turns, max_completion_length))
    return trajectories, encoded


def result_text(tokenizer) -> str:
    """The tool-result turn `calculator_rollout` appends after every call."""
    from alignment.tools.formats import ToolFormat

    return ToolFormat("hermes", native=False).result_text(tokenizer, [("calculator", ONE_PLUS_ONE)])


def sampled_runs(t) -> list[tuple[bool, list[int]]]:
    """A trajectory's ids after the prompt as runs of (sampled by the model, ids)."""
    runs: list[tuple[bool, list[int]]] = []
    for token, sampled in zip(t.ids, t.mask):
        if runs and runs[-1][0] == bool(sampled):
            runs[-1][1].append(token)
        else:
            runs.append((bool(sampled), [token]))
    return runs


def assert_token_in_token_out(model, tokenizer, trajectories, encoded: list[str], atol: float) -> None:
    """Of `calculator_rollout`'s result: each trajectory is model turns and tool results appended as ids, and
    only the tool outputs and result turns were tokenized (never the model's turns, not even to check them); the
    results (their turn's text tokenized alone) are masked out and carry log-prob 0; re-scoring prompt + trajectory
    in one forward pass of the policy gives the sampler's log-probs on the tokens the mask marks as sampled."""
    from alignment.data.formatting import encode

    assert sum(t.counts["tool_calls"] for t in trajectories) >= 2, "the test must exercise tool turns"
    assert set(encoded) == {ONE_PLUS_ONE, result_text(tokenizer)}
    model.eval()
    for t in trajectories:
        assert len(t.ids) == len(t.mask) == len(t.logprobs)
        assert all(ids == encode(tokenizer, result_text(tokenizer)) for sampled, ids in sampled_runs(t) if not sampled)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if not m)
        with torch.no_grad():
            logits = model(torch.tensor([t.prompt_ids + t.ids])).logits[0, len(t.prompt_ids) - 1 : -1].float()
        policy = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.ids)[:, None])[:, 0]
        sampled = torch.tensor(t.mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(t.logprobs)[sampled], policy[sampled], atol=atol, rtol=0)


def engine_requests(monkeypatch) -> list[list[tuple[list[int], list[int]]]]:
    """Filled, per call of the vLLM engine, with (the prompt ids the engine reports it was fed, the ids it sampled)
    of each completion."""
    from alignment.sampling import vllm_engine

    calls: list[list[tuple[list[int], list[int]]]] = []
    sample = vllm_engine._sample

    def recorded(*args, **kwargs):
        outputs = sample(*args, **kwargs)
        calls.append([(list(r.prompt_token_ids), list(c.token_ids)) for r in outputs for c in r.outputs])
        return outputs

    monkeypatch.setattr(vllm_engine, "_sample", recorded)
    return calls


def assert_fed_turn_by_turn(trajectories, requests: list) -> None:
    """The engine was called once per turn with every unfinished trajectory's prompt and ids so far, and each
    model turn of a trajectory is the ids the engine returned, verbatim."""
    expected: list[list] = [[] for _ in requests]
    for t in trajectories:
        fed, turn = list(t.prompt_ids), 0
        for sampled, ids in sampled_runs(t):
            if sampled:
                expected[turn].append((list(fed), ids))
                turn += 1
            fed += ids
    assert [sorted(e) for e in expected] == [sorted(r) for r in requests]


def shaken(model, seed: int = 1, scale: float = 0.5):
    """`model` with every weight moved by Gaussian noise (in place): a random-init model then stops at different
    steps when decoding greedily (some rows at once), which exercises rows leaving the batch."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)
    return model
