"""What this CPU multiplies fast (alignment/runtime/cpu.py) and who asks it: `align check` refuses bf16 sampling and
bf16 training on a CPU without native bf16 (AVX512-BF16 or AMX), naming the key; the sampler warns a program that
asks anyway; on a native-bf16 CPU nothing changes. The lower ISA is forced for real with oneDNN's
ONEDNN_MAX_CPU_ISA=AVX2 in a subprocess (on an AVX2 host it is the host's own), or by a patched `bf16_native`."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from conftest import recipe_dict, run_cli, sft_recipe, write_recipe
from helpers import tiny_ppo_recipe

from alignment.config.recipe import load_recipe
from alignment.config.sampling import SamplingSpec
from alignment.errors import UserError
from alignment.models.loading import load_policy
from alignment.models.tokenizer import load_tokenizer
from alignment.run.runner import check_recipe
from alignment.runtime import cpu
from alignment.sampling import generate

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU bf16 is the GPU's business: nothing refused")


@pytest.fixture
def without_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu, "bf16_native", lambda: False)
    monkeypatch.setattr(cpu, "matmul_rates", lambda: {"float32": 100.0, "bfloat16": 1.0})


@pytest.mark.parametrize("cap", ["AVX2", "avx512_core", "SSE41"])
def test_an_isa_cap_below_avx512_bf16_means_no_native_bf16(monkeypatch, cap):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert cpu.isa_cap() == cap.upper() and not cpu.bf16_native()
    assert "ONEDNN_MAX_CPU_ISA" in cpu.why_not_native() or "neither AVX512-BF16 nor AMX" in cpu.why_not_native()


def test_a_cap_at_or_above_avx512_bf16_leaves_the_answer_alone(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    native = cpu.bf16_native()
    for cap in ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert cpu.bf16_native() == native


def test_the_forced_lower_isa_is_real_for_torch_too():
    """With ONEDNN_MAX_CPU_ISA=AVX2 set before torch starts, torch's own check says oneDNN runs no bf16 matmul (so
    torch takes its slow path), and `bf16_native` agrees: on an AMX Xeon as on an AVX2 host."""
    code = (
        "import torch; from alignment.runtime import cpu; "
        "print(torch.ops.mkldnn._is_mkldnn_bf16_supported(), cpu.bf16_native())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
    )
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_bf16_requests_finds_sampling_blocks_and_train_flags(tmp_path):
    stage = {
        "data": {"task": "arithmetic"},
        "train": {"bf16": True},
        "on_policy": {"verifier": "arithmetic", "dtype": "bfloat16"},
    }
    loaded = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "dpo", stage)))
    keys = [key for key, _ in cpu.bf16_requests(loaded.stages["dpo"], "stages.dpo")]
    assert sorted(keys) == ["stages.dpo.on_policy.dtype", "stages.dpo.train.bf16"]
    assert cpu.bf16_requests(SamplingSpec(), "s") == []
    assert cpu.bf16_requests({"a": [SamplingSpec(dtype="bfloat16")]}, "x") == [
        ("x.a.0.dtype", "samples on a bf16 copy of the weights")
    ]


def test_bf16_requests_finds_an_evaluate_blocks_suites(tmp_path):
    suite = {
        "name": "arith",
        "data": {"task": "arithmetic", "n": 4},
        "sampling": {"dtype": "bfloat16"},
        "pass_k": {"n": 2},
    }
    recipe = {**sft_recipe(tmp_path), "evaluate": {"suites": [suite]}}
    loaded = load_recipe(write_recipe(tmp_path, recipe))
    keys = [key for key, _ in cpu.bf16_requests(loaded.evaluate, "evaluate")]
    assert keys == ["evaluate.suites.0.sampling.dtype", "evaluate.suites.0.pass_k.dtype"]  # pass_k inherits dtype


@no_gpu
def test_align_check_refuses_bf16_sampling_under_the_forced_lower_isa(tmp_path, tiny_model):
    """`align check` under ONEDNN_MAX_CPU_ISA=AVX2: exits 2 without a traceback, naming the key, the reason, the
    rates it measured and the alternative."""
    path = tiny_ppo_recipe(tmp_path, tiny_model, rollout={"dtype": "bfloat16"})
    done = run_cli("check", path, env={"ONEDNN_MAX_CPU_ISA": "AVX2"}, timeout=600)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "stages.ppo.rollout.dtype" in message and "GFLOP/s" in message and "drop `dtype`" in message


@no_gpu
def test_check_refuses_bf16_training_on_such_a_cpu(tmp_path, without_native_bf16):
    recipe = sft_recipe(tmp_path, train={"max_steps": 1, "bf16": True})
    with pytest.raises(UserError, match=r"stages\.sft\.train\.bf16: trains in bf16.*drop `bf16`"):
        check_recipe(load_recipe(write_recipe(tmp_path, recipe)))


@no_gpu
def test_check_refuses_bf16_sampling_on_such_a_cpu_and_passes_it_on_a_native_one(
    tmp_path, tiny_model, monkeypatch, without_native_bf16
):
    loaded = load_recipe(tiny_ppo_recipe(tmp_path, tiny_model, rollout={"dtype": "bfloat16"}))
    with pytest.raises(UserError, match=r"stages\.ppo\.rollout\.dtype: .*1\.0 GFLOP/s here against fp32's 100\.0"):
        check_recipe(loaded)
    monkeypatch.setattr(cpu, "bf16_native", lambda: True)  # an AMX or AVX512-BF16 CPU: as before
    check_recipe(loaded)


@no_gpu
def test_check_refuses_an_rsft_stages_bf16_sampling_on_such_a_cpu(tmp_path, tiny_model, without_native_bf16):
    stage = {
        "data": {"task": "arithmetic", "n": 16},
        "verifiers": ["arithmetic"],
        "sampling": {"n": 2, "max_new_tokens": 6, "dtype": "bfloat16"},
        "train": {"max_steps": 1},
    }
    loaded = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rsft", stage, model=str(tiny_model))))
    with pytest.raises(UserError, match=r"stages\.rsft\.sampling\.dtype: samples on a bf16 copy"):
        check_recipe(loaded)


def test_a_recipe_without_bf16_passes_on_any_cpu(tmp_path, tiny_model, without_native_bf16):
    check_recipe(load_recipe(tiny_ppo_recipe(tmp_path, tiny_model)))


def test_the_sampler_warns_once_and_samples_as_asked(tiny_model, prompts, monkeypatch, without_native_bf16, caplog):
    model, tokenizer = load_policy(str(tiny_model)), load_tokenizer(str(tiny_model))
    monkeypatch.setattr(cpu, "_warned", False)
    settings = SamplingSpec(max_new_tokens=4, dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="alignment"):
        generate(model, tokenizer, prompts, settings)
        generate(model, tokenizer, prompts, settings)
    warned = [r for r in caplog.records if "dtype: bfloat16" in r.getMessage()]
    assert len(warned) == 1 and "slower than fp32 here" in warned[0].getMessage()


def test_the_sampler_says_nothing_on_a_native_cpu(tiny_model, prompts, monkeypatch, caplog):
    monkeypatch.setattr(cpu, "bf16_native", lambda: True)
    monkeypatch.setattr(cpu, "_warned", False)
    model, tokenizer = load_policy(str(tiny_model)), load_tokenizer(str(tiny_model))
    with caplog.at_level(logging.WARNING, logger="alignment"):
        generate(model, tokenizer, prompts, SamplingSpec(max_new_tokens=4, dtype="bfloat16"))
    assert not [r for r in caplog.records if "dtype: bfloat16" in r.getMessage()]


@no_gpu
def test_check_refuses_an_evaluate_blocks_bf16_suite_on_such_a_cpu(tmp_path, without_native_bf16):
    suite = {"name": "arith", "data": {"task": "arithmetic", "n": 4}, "sampling": {"dtype": "bfloat16"}}
    recipe = {**sft_recipe(tmp_path, train={"max_steps": 1}), "evaluate": {"suites": [suite]}}
    with pytest.raises(UserError, match=r"evaluate\.suites\.0\.sampling\.dtype: samples on a bf16 copy"):
        check_recipe(load_recipe(write_recipe(tmp_path, recipe)))
