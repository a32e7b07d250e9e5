"""`engine: loop` (the default sampler, sampling/decode.py) against `engine: generate` (one `model.generate` call per
batch, the sampler it replaced) on every path that samples: ppo rollouts, rsft, on-policy preference pairs, an
evaluation suite (greedy, pass@k, KL samples) and multi-turn tool rollouts (an evaluation suite, rsft and rlvr with
`tools:`), each a tiny real stage or evaluation.

Every call a path makes to the transformers sampler runs twice from the same torch RNG state, once per engine
(`EngineCheck`): the same token ids, stops and texts, the same RNG state afterwards (so whatever the stage draws
next is the same too), and log-probs within LOGPROB_ATOL of those of generate's raw logits (asked for on every
call; recording the logits leaves generate's ids alone); the loop's samples go on. Where a recipe can name the
engine, the path runs again with `engine: generate` in its sampling blocks: every call must then go through
`generate`, and the stage's outputs (samples, selections, metrics, trained weights) equal the default run's.

The policy is the tiny model with shaken weights and every lowercase letter an EOS id, so that greedy and sampled
rows stop at different steps and the loop's compaction runs on the paths' own calls.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import recipe_dict, write_recipe
from helpers import patch_everywhere, quick_stopping, tiny_ppo_recipe, trainable_digest

from alignment.config.evaluate import SuiteSpec
from alignment.config.recipe import load_recipe
from alignment.evaluation.evaluate import evaluate_checkpoints
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import run_recipe
from alignment.sampling import hf
from alignment.tools.formats import Call, ToolFormat

# A verifier the random policy passes about half the time, so selection and pairs have both sides.
LENGTH_PARITY = "def length_parity(completion):\n    return float(len(completion) % 2)\n"
VERIFIER = "my_checks:length_parity"
# Log-probs agree bit for bit until the loop drops finished rows; the rows left then run in a smaller batch, whose
# matmuls the CPU's BLAS may sum in another order (a [1-4, 64] x [64, n] product differs from the same rows of an
# [8, 64] one in the last bits here), which moves later log-probs by a few ulps of the logits, more over longer
# completions: at most 5e-5 measured here. A wrong position, mask or temperature moves them by tenths.
LOGPROB_ATOL = 1e-3


@dataclass
class Recorded:
    engine: str
    temperature: float
    varied: bool  # rows of the call stopped at different steps (the loop dropped finished rows)


class EngineCheck:
    """Stands in for `hf.generate_ids`. A call with `engine: loop` is run with `engine: generate` first (asking it
    for log-probs, which only records its logits), then, from the same RNG state, as asked; the two must agree.
    Every call is recorded."""

    def __init__(self, original):
        self.original, self.calls, self.drift = original, [], 0.0

    def __call__(self, model, tokenizer, encoded, settings, progress=None, logprobs=False):
        if settings.engine != "loop":
            samples = self.original(model, tokenizer, encoded, settings, progress, logprobs)
        else:
            state = torch.get_rng_state()
            reference = self.original(
                model, tokenizer, encoded, settings.model_copy(update={"engine": "generate"}), progress, logprobs=True
            )
            after = torch.get_rng_state()
            torch.set_rng_state(state)
            samples = self.original(model, tokenizer, encoded, settings, progress, logprobs)
            where = f"call {len(self.calls)} ({settings.temperature=}, {settings.n=}, {len(encoded)} prompts)"
            for k, (ref, got) in enumerate(zip(reference, samples, strict=True)):
                assert got.token_ids == ref.token_ids, f"{where}, sample {k}: {first_difference(ref, got)}"
                assert (got.prompt_index, got.finished, got.text) == (ref.prompt_index, ref.finished, ref.text), where
                assert len(got.logprobs) == len(ref.logprobs), where
                drift = max([abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)], default=0.0)
                assert drift <= LOGPROB_ATOL, f"{where}, sample {k}: log-probs differ by {drift}"
                self.drift = max(self.drift, drift)
            assert torch.equal(torch.get_rng_state(), after), f"{where}: the engines leave different RNG states"
        lengths = {len(s.token_ids) for s in samples}
        self.calls.append(Recorded(settings.engine, settings.temperature, len(lengths) > 1))
        return samples


def first_difference(reference, got) -> str:
    at = next(
        (t for t, (a, b) in enumerate(zip(reference.token_ids, got.token_ids)) if a != b),
        min(len(reference.token_ids), len(got.token_ids)),
    )
    return (
        f"first differing token at step {at}: generate {reference.token_ids[at : at + 1]}, "
        f"loop {got.token_ids[at : at + 1]}"
    )


@pytest.fixture(scope="module")
def policy(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("paths")
    model = load_policy(str(tiny_model))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(folder / "shaken")
    load_tokenizer(str(tiny_model)).save_pretrained(folder / "shaken")
    return quick_stopping(folder / "shaken", folder / "policy")


def with_engine(block: dict, engine: str | None) -> dict:
    return {**block, "engine": engine} if engine else block


def run_stage(folder: Path, kind: str, stage: dict, policy: Path, **top) -> Path:
    """Run a one-stage recipe on `policy` with the length-parity verifier beside it; returns the stage's folder."""
    folder.mkdir(parents=True)
    (folder / "my_checks.py").write_text(LENGTH_PARITY)
    recipe = load_recipe(write_recipe(folder, recipe_dict(folder, kind, stage, str(policy), **top)))
    run_recipe(recipe)
    return recipe.stage_dir(kind)


def weights(path: Path) -> dict[str, bytes]:
    """A safetensors file's tensors as bytes, to compare bit for bit with `==`."""
    return {name: tensor.numpy().tobytes() for name, tensor in trainable_digest(path).items()}


def files(folder: Path, *names: str) -> dict[str, str]:
    texts = {name: (folder / name).read_text() for name in names}
    assert all(text.strip() for text in texts.values()), "two runs are compared on what they wrote: not nothing"
    return texts


def run_ppo(folder: Path, policy: Path, engine: str | None, merge_lora: bool = True):
    """LoRA, merged for sampling unless told: the second rollout samples through a trained (non-zero) adapter."""
    rollout = {"batch_size": 8, "max_new_tokens": 8, "merge_lora": merge_lora}
    path = tiny_ppo_recipe(folder, policy, rollout=with_engine(rollout, engine), train={"total_updates": 2})
    run_recipe(load_recipe(path))
    out = folder / "out" / "ppo"
    history = json.loads((out / "log_history.json").read_text())
    return (
        [(h["score"], h["kl"], h["response_length"]) for h in history],
        weights(out / "adapter" / "adapter_model.safetensors"),
    )


def run_rsft(folder: Path, policy: Path, engine: str | None):
    stage = {
        "data": {"task": "arithmetic", "split": "train", "n": 8},
        "verifiers": [VERIFIER],
        "sampling": with_engine({"n": 4, "max_new_tokens": 8, "temperature": 1.0, "batch_size": 6}, engine),
        "select": "threshold",
        "threshold": 1.0,
        "train": {"max_steps": 1, "per_device_train_batch_size": 8, "max_length": 64},
    }
    return files(run_stage(folder, "rsft", stage, policy), "selected_round1.jsonl")


def run_on_policy_pairs(folder: Path, policy: Path, engine: str | None):
    stage = {
        "data": {"task": "arithmetic", "split": "train", "n": 8},
        "on_policy": with_engine(
            {"verifier": VERIFIER, "n": 4, "temperature": 0.9, "top_k": 20, "max_new_tokens": 8, "batch_size": 6},
            engine,
        ),
        "train": {"max_steps": 1, "per_device_train_batch_size": 4, "logging_steps": 1},
    }
    out = run_stage(folder, "dpo", stage, policy, lora={"r": 4, "lora_alpha": 8})
    metrics = json.loads((out / "stage.json").read_text())["metrics"]
    return (
        {k: metrics[k] for k in ("pairs_built", "prompts_dropped")},
        weights(out / "adapter" / "adapter_model.safetensors"),
    )


def run_evaluation(folder: Path, policy: Path, engine: str | None):
    """Greedy main completions, pass@k at temperature 0.8 with top-p, and (as that is not the policy's own
    distribution) temperature-1 samples for the KL. The KL's policy term is the loop's own log-probs, and a
    re-score by the policy under `engine: generate` (which records none): equal to fp32 rounding, so compared to
    1e-4 (the KL to itself, 0 with the re-score, is up to 1e-5 from the loop's). The reference is a copy of the
    policy: the policy itself as reference would have its KL set to 0 without sampling."""
    reference = folder / "reference"
    if not reference.exists():
        shutil.copytree(policy, reference)
    suite = SuiteSpec(
        name="arith",
        data={"task": "arithmetic", "split": "test", "n": 6},
        verifier="arithmetic",
        sampling=with_engine({"temperature": 0, "max_new_tokens": 8, "batch_size": 4}, engine),
        pass_k=with_engine({"n": 4, "k": [2, 4], "temperature": 0.8, "top_p": 0.9}, engine),
    )
    evaluate_checkpoints({"policy": str(policy)}, [suite], folder / "eval", reference=str(reference))
    lines = [json.loads(line) for line in (folder / "eval" / "samples.jsonl").read_text().splitlines()]
    assert any("kl" in line for line in lines)
    return [{**line, **({"kl": round(line["kl"], 4)} if "kl" in line else {})} for line in lines]


def run_tool_evaluation(folder: Path, policy: Path, engine: str | None):
    suite = SuiteSpec(
        name="products",
        data={"task": "tool_arithmetic", "split": "test", "n": 8},
        verifier="arithmetic",
        tools=["calculator"],
        tool_format="hermes",
        describe_tools=False,
        max_turns=3,
        sampling=with_engine({"temperature": 1.0, "max_new_tokens": 200}, engine),
    )
    evaluate_checkpoints({"policy": str(policy)}, [suite], folder / "eval")
    return files(folder / "eval", "samples.jsonl")


def run_tool_rsft(folder: Path, policy: Path, engine: str | None):
    stage = {
        "data": {"task": "tool_arithmetic", "split": "train", "n": 6},
        "verifiers": [VERIFIER],
        "tools": ["calculator"],
        "tool_format": "hermes",
        "describe_tools": False,
        "max_turns": 3,
        "sampling": with_engine({"n": 2, "max_new_tokens": 200, "temperature": 1.0}, engine),
        "select": "threshold",
        "threshold": 1.0,
        "train": {"max_steps": 1, "per_device_train_batch_size": 4, "max_length": 256},
    }
    return files(run_stage(folder, "rsft", stage, policy), "selected_round1.jsonl")


def run_tool_rlvr(folder: Path, policy: Path, engine: str | None):
    """GRPO's rollout_func builds its sampling settings from TRL's arguments: no engine to name."""
    assert engine is None
    stage = {
        "data": {"task": "arithmetic", "split": "train", "n": 8},
        "verifiers": ["arithmetic"],
        "tools": ["calculator"],
        "tool_format": "hermes",
        "max_turns": 3,
        "max_tool_output_tokens": 16,
        "train": {
            "max_steps": 1,
            "num_generations": 4,
            "per_device_train_batch_size": 8,
            "max_completion_length": 200,
            "logging_steps": 1,
        },
    }
    run_stage(folder, "rlvr", stage, policy)


class SamplingPath(NamedTuple):
    run: Callable
    names_engine: bool  # a recipe can set its sampling block's `engine`
    temperatures: set  # of the calls it makes
    calls: int  # at least this many (a multi-turn rollout calls the sampler once per turn)


PATHS = {
    "ppo": SamplingPath(run_ppo, True, {1.0}, 2),
    "ppo-unmerged-lora": SamplingPath(functools.partial(run_ppo, merge_lora=False), True, {1.0}, 2),
    "rsft": SamplingPath(run_rsft, True, {1.0}, 1),
    "on-policy-pairs": SamplingPath(run_on_policy_pairs, True, {0.9}, 1),
    "evaluation": SamplingPath(run_evaluation, True, {0, 0.8, 1.0}, 3),
    "tools-evaluation": SamplingPath(run_tool_evaluation, True, {1.0}, 2),
    "tools-rsft": SamplingPath(run_tool_rsft, True, {1.0}, 2),
    "tools-rlvr": SamplingPath(run_tool_rlvr, False, {1.0}, 2),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_sampling_path_gets_from_the_loop_what_generate_gives(path, policy, tmp_path, monkeypatch):
    run, names_engine, temperatures, calls = PATHS[path]
    # The random policy writes no tool calls: two closed turns in three (by their length) are read as one, so
    # rollouts run one to max_turns turns, and some end with an answer.
    monkeypatch.setattr(
        ToolFormat,
        "parse",
        lambda self, text: ([Call("calculator", {"expression": "2*3"})] if len(text) % 3 else [], []),
    )
    runs = {}
    for engine in [None, "generate"] if names_engine else [None]:
        check = EngineCheck(hf.generate_ids)
        with monkeypatch.context() as patch:
            patch_everywhere(patch, hf, "generate_ids", check)
            runs[engine] = run(tmp_path / (engine or "default"), policy, engine)
        assert len(check.calls) >= calls, f"{path}: {len(check.calls)} calls of the sampler"
        assert {c.engine for c in check.calls} == {engine or "loop"}, (
            f"{path}: the recipe's engine must reach every call"
        )
        assert {c.temperature for c in check.calls} == temperatures
        if engine is None:
            assert any(c.varied for c in check.calls), "rows must stop at different steps"
            print(f"{path}: {len(check.calls)} calls, largest log-prob difference {check.drift:.3g}")
    if names_engine:
        assert runs["generate"] == runs[None]
