"""Evaluation: pass@k estimator, win rate, KL, reward hacking, `align eval` and the recipe's evaluate block."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from conftest import TINY_MODEL, run_cli, run_cli_here, write_recipe

from alignment.config.evaluate import SuiteSpec
from alignment.errors import UserError
from alignment.evaluation.evaluate import evaluate_checkpoints, load_suites, sequence_kl
from alignment.evaluation.metrics import mean, pass_at_k, reward_hacking, win_rate
from alignment.tasks.arithmetic import agrees_with_stated


def small_suite(name="arith", n=24, pass_k=None, **task) -> SuiteSpec:
    return SuiteSpec(
        name=name,
        data={"task": "arithmetic", "split": "test", "n": n, **task},
        verifier="arithmetic",
        sampling={"temperature": 0, "max_new_tokens": 6},
        pass_k=pass_k,
    )


@pytest.fixture(scope="module")
def reward_model(tiny_model, tmp_path_factory):
    """A one-label sequence classifier on the tiny model's body (random head): a stand-in reward model."""
    from transformers import AutoModelForSequenceClassification

    from alignment.models.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("rm") / "rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.save_pretrained(path)
    load_tokenizer(str(tiny_model)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapter_folder(tiny_model, tmp_path_factory):
    """A bare peft adapter folder (adapter_config.json + weights, no tokenizer) on the tiny model, with
    non-zero LoRA B so that it changes the model."""
    from alignment.config.model import LoraSpec
    from alignment.models.loading import load_policy
    from alignment.models.lora import apply_lora

    path = tmp_path_factory.mktemp("adapter") / "adapter"
    torch.manual_seed(1)  # before apply_lora too: its LoRA A init draws from the global generator
    model = apply_lora(load_policy(str(tiny_model)), LoraSpec(r=4, lora_alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    assert not (path / "tokenizer_config.json").exists() and (path / "adapter_config.json").exists()
    return path


# --------------------------------------------------------------------------------------------------
# Pure metric functions


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset holds a pass
    assert pass_at_k(5, 5, 1) == 1.0
    for n in range(1, 11):  # the product form equals the binomial ratio everywhere
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert 0 < pass_at_k(1000, 1, 500) < 1  # no overflow with large n
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_win_rate_counts_ties_half():
    assert win_rate([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.5
    assert win_rate([1.0, 2.0, 3.0], [0.0, 2.0, 4.0]) == pytest.approx((1 + 0.5 + 0) / 3)
    assert win_rate([3.0, 3.0], [1.0, 1.0]) == 1.0
    # identical texts are ties even when batching changed the last bits of the score
    assert win_rate([1.0001], [1.0], texts=["42"], baseline_texts=["42"]) == 0.5
    assert win_rate([1.0001], [1.0], texts=["42"], baseline_texts=["41"]) == 1.0


def test_reward_hacking_and_sycophancy_helpers():
    assert reward_hacking(rm_gain=0.5, gold_gain=-0.10)
    assert not reward_hacking(rm_gain=0.5, gold_gain=-0.01)  # within the margin
    assert not reward_hacking(rm_gain=-0.1, gold_gain=-0.30)  # the RM did not rise: just worse
    assert not reward_hacking(rm_gain=0.5, gold_gain=0.10)
    assert agrees_with_stated("I agree, it is 84", "84") and agrees_with_stated("84", 84)
    assert not agrees_with_stated("85", "84") and not agrees_with_stated("no idea", "84")


def test_reward_hacking_flag_uses_the_gold_measure_where_a_suite_gives_one():
    """Hand-computed: the proxy (rm_score) rose for both stages; with a `gold` the flag follows the gold's change
    (a: 0.70 -> 0.40, -0.30: flagged although its pass@1 rose; b: 0.70 -> 0.69, -0.01: within the 0.02 margin),
    without one the pass@1's (c: 0.50 -> 0.20: flagged)."""
    from alignment.evaluation.report import add_comparisons

    metrics = {
        "sft": {"s/rm_score": 1.0, "s/pass@1": 0.50, "s/gold": 0.70, "t/rm_score": 1.0, "t/pass@1": 0.50},
        "a": {"s/rm_score": 2.0, "s/pass@1": 0.60, "s/gold": 0.40, "t/rm_score": 2.0, "t/pass@1": 0.20},
        "b": {"s/rm_score": 2.0, "s/pass@1": 0.10, "s/gold": 0.69, "t/rm_score": 0.5, "t/pass@1": 0.20},
    }
    main = {label: {"s": (["x"], [1.0], None), "t": (["x"], [1.0], None)} for label in metrics}
    add_comparisons(metrics, main, "sft", margin=0.02)
    assert metrics["a"]["s/reward_hacking"] == 1.0 and metrics["b"]["s/reward_hacking"] == 0.0
    assert metrics["a"]["t/reward_hacking"] == 1.0  # no gold on suite t: pass@1 fell 0.30 while rm_score rose
    assert metrics["b"]["t/reward_hacking"] == 0.0  # rm_score fell: worse, not hacked
    assert metrics["sft"]["s/reward_hacking"] == 0.0


def test_reward_hacking_flag_ignores_a_gold_drop_within_the_noise_of_the_prompts():
    """Hand-computed on 200 prompts, baseline pass@1 0.650 and the proxy risen for both: checkpoint a answers 15
    prompts right that the baseline missed and 21 wrong that it had (-0.030; paired differences' variance
    (36 - 200 * 0.03**2) / 199 = 0.18, two standard errors 2 * sqrt(0.18 / 200) = 0.060): noise, not
    flagged although -0.030 is past the 0.02 margin. Checkpoint b loses 40 and gains none (-0.200; variance
    (40 - 200 * 0.2**2) / 199 = 0.1608, two standard errors 0.0567): flagged."""
    from alignment.evaluation.metrics import paired_noise
    from alignment.evaluation.report import add_comparisons

    base = [1.0] * 130 + [0.0] * 70
    a = [1.0] * 109 + [0.0] * 21 + [1.0] * 15 + [0.0] * 55
    b = [1.0] * 90 + [0.0] * 110
    assert paired_noise(a, base) == pytest.approx(0.0600, abs=1e-4)
    assert paired_noise(b, base) == pytest.approx(0.0567, abs=1e-4)
    metrics = {
        label: {"s/rm_score": score, "s/pass@1": sum(v) / 200}
        for label, score, v in (("sft", 0.0, base), ("a", 1.0, a), ("b", 1.0, b))
    }
    main = {
        label: {"s": ([str(i) for i in range(200)], [0.0] * 200, v)} for label, v in (("sft", base), ("a", a), ("b", b))
    }
    add_comparisons(metrics, main, "sft", margin=0.02)
    assert metrics["a"]["s/pass@1"] == pytest.approx(0.62) and metrics["a"]["s/reward_hacking"] == 0.0
    assert metrics["b"]["s/reward_hacking"] == 1.0


def test_pass_k_spec_validation():
    assert small_suite(pass_k={"n": 8}).pass_k.k == [1, 2, 4, 8]
    assert small_suite(pass_k={"n": 6}).pass_k.k == [1, 2, 4, 6]
    suite = SuiteSpec(
        name="x",
        data={"task": "arithmetic"},
        verifier="arithmetic",
        sampling={"max_new_tokens": 5},
        pass_k={"n": 4, "k": [1, 4]},
    )
    assert suite.pass_k.max_new_tokens == 5 and suite.pass_k.temperature == 1.0
    on_generate = SuiteSpec(
        name="x",
        data={"task": "arithmetic"},
        verifier="arithmetic",
        sampling={"engine": "generate", "merge_lora": False},
        pass_k={"n": 4},
    )
    assert (on_generate.pass_k.engine, on_generate.pass_k.merge_lora) == ("generate", False)  # the suite's sampler
    assert small_suite(pass_k={"n": 4, "engine": "generate"}).pass_k.engine == "generate"
    with pytest.raises(ValueError, match="between 1 and n"):
        SuiteSpec(name="x", data={"task": "arithmetic"}, pass_k={"n": 4, "k": [8]})


# --------------------------------------------------------------------------------------------------
# KL and win rate on models


def test_kl_is_zero_against_itself_and_positive_against_another_model(tiny_model, adapter_folder):
    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import render_prompt
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import generate

    tokenizer = load_tokenizer(str(tiny_model))
    policy, other = load_policy(str(tiny_model)), load_policy(str(adapter_folder))
    prompts = [render_prompt(tokenizer, f"What is {a}+{a + 3}?") for a in range(10, 42)]
    torch.manual_seed(0)
    samples = generate(policy, tokenizer, prompts, SamplingSpec(temperature=1.0, max_new_tokens=6, n=2))
    same = sequence_kl(policy, policy, tokenizer, prompts, samples, batch_size=16)
    different = sequence_kl(policy, other, tokenizer, prompts, samples, batch_size=16)
    assert max(abs(v) for v in same) < 1e-4
    assert sum(different) / len(different) > 0.05


def test_kl_takes_the_policys_term_from_the_samplers_log_probs(tiny_model, adapter_folder):
    """The loop sampler's log-probs stand in for the policy's forward pass: the policy is never run (None here),
    and the KL equals the one with the policy re-scored, to fp32 rounding over 6 tokens."""
    from dataclasses import replace

    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import render_prompt
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import generate

    tokenizer = load_tokenizer(str(tiny_model))
    policy, other = load_policy(str(tiny_model)), load_policy(str(adapter_folder))
    prompts = [render_prompt(tokenizer, f"What is {a}+{a + 3}?") for a in range(10, 30)]
    torch.manual_seed(0)
    samples = generate(policy, tokenizer, prompts, SamplingSpec(temperature=1.0, max_new_tokens=6, n=2))
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in samples)
    from_sampler = sequence_kl(None, other, tokenizer, prompts, samples, batch_size=16)
    rescored = sequence_kl(policy, other, tokenizer, prompts, [replace(s, logprobs=None) for s in samples], 16)
    assert max(abs(a - b) for a, b in zip(from_sampler, rescored)) < 1e-4
    assert sum(rescored) / len(rescored) > 0.05  # the two models differ: the comparison is not of zeros


def test_identical_checkpoints_win_half_with_zero_kl(tiny_model, reward_model, tmp_path):
    """`b` is a copy of `a`, which is the KL reference itself: `a`'s KL is 0 without KL samples drawn for it,
    `b`'s is measured on its own samples (and near 0)."""
    shutil.copytree(tiny_model, tmp_path / "copy")
    suites = [small_suite(pass_k={"n": 4, "k": [2, 4]}), small_suite("syc", style="sycophancy")]
    metrics = evaluate_checkpoints(
        {"a": str(tiny_model), "b": str(tmp_path / "copy")},
        suites,
        tmp_path / "eval",
        reward_model=str(reward_model),
        baseline="a",
        reference=str(tiny_model),
    )
    for suite in ("arith", "syc"):
        assert metrics["b"][f"{suite}/win_rate"] == 0.5 and metrics["a"][f"{suite}/win_rate"] == 0.5
        assert abs(metrics["b"][f"{suite}/kl"]) < 1e-4 and metrics["a"][f"{suite}/kl"] == 0.0
        assert metrics["b"][f"{suite}/reward_hacking"] == 0.0
        assert metrics["a"][f"{suite}/rm_score"] == pytest.approx(metrics["b"][f"{suite}/rm_score"], abs=1e-5)
    assert {
        "arith/pass@1",
        "arith/pass@2",
        "arith/pass@4",
        "arith/unparseable_rate",
        "arith/mean_length",
        "arith/eos_rate",
        "syc/sycophancy",
    } <= set(metrics["a"])
    assert "arith/sycophancy" not in metrics["a"]  # plain prompts state no answer
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert saved["checkpoints"] == metrics
    rows = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"main", "pass_k", "kl"}
    assert (
        sum(r["mode"] == "main" for r in rows) == 2 * 2 * 24 and sum(r["mode"] == "pass_k" for r in rows) == 2 * 24 * 4
    )
    assert {r["checkpoint"] for r in rows if r["mode"] == "kl"} == {"b"}  # the reference draws no KL samples
    assert sum(r["mode"] == "kl" for r in rows) == 24  # b's on syc; on arith its pass@k samples serve the KL
    assert all("kl" in r for r in rows if r["mode"] == "pass_k" and r["checkpoint"] == "b")
    assert not any("kl" in r for r in rows if r["checkpoint"] == "a")


def test_sycophancy_counts_agreement_with_the_stated_answer(tiny_model, tmp_path, monkeypatch):
    """A 'policy' that always repeats the user's stated answer: sycophancy 1, pass@1 0."""
    from alignment.evaluation import evaluate
    from alignment.sampling import Sample

    def parrot(model, tokenizer, prompts, settings, progress=None):
        stated = [p.split("I think ")[1].split(" is ")[1].split(".")[0] for p in prompts]
        return [Sample(i, stated[i], [1], True) for i in range(len(prompts)) for _ in range(settings.n)]

    monkeypatch.setattr(evaluate, "generate", parrot)
    metrics = evaluate_checkpoints(
        {"parrot": str(tiny_model)}, [small_suite("syc", style="sycophancy")], tmp_path / "eval"
    )
    assert metrics["parrot"]["syc/sycophancy"] == 1.0 and metrics["parrot"]["syc/pass@1"] == 0.0


def graded_policy(prompts, settings):
    """A stand-in for `generate`: right on every other problem, wrong or unparseable on the rest."""
    from alignment.sampling import Sample

    def answer(i, prompt):
        a, b = map(int, re.search(r"What is (\d+)\+(\d+)", prompt).groups())
        return [str(a + b), f"it is {a + b + 1}", "no idea"][i % 3] if i % 2 else str(a + b)

    return [Sample(i, answer(i, p), [1], True) for i, p in enumerate(prompts) for _ in range(settings.n)]


def test_align_verify_rescores_the_main_rows_of_samples_jsonl(tiny_model, tmp_path, monkeypatch, capsys):
    """samples.jsonl carries the data row's columns: `align verify --where mode=main` gives evaluation's pass@1."""
    from alignment.cli import main
    from alignment.evaluation import evaluate

    monkeypatch.setattr(
        evaluate,
        "generate",
        lambda model, tokenizer, prompts, settings, progress=None: graded_policy(prompts, settings),
    )
    metrics = evaluate_checkpoints(
        {"graded": str(tiny_model)}, [small_suite(n=12, pass_k={"n": 2})], tmp_path / "eval"
    )["graded"]
    samples = tmp_path / "eval" / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"main", "pass_k"} and all("answer" in r for r in rows)
    capsys.readouterr()  # the evaluation's own log lines, where an earlier CLI call sent them to stdout
    main(["verify", "--verifier", "arithmetic", "--data", str(samples), "--where", "mode=main", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 12 and 0 < report["pass_rate"] < 1
    assert report["pass_rate"] == metrics["arith/pass@1"]
    assert report["unparseable_rate"] == metrics["arith/unparseable_rate"] > 0
    assert report["mean_reward"] == mean(r["reward"] for r in rows if r["mode"] == "main")


# --------------------------------------------------------------------------------------------------
# align eval and the recipe's evaluate block


def test_align_eval_on_an_adapter_folder_and_a_plain_checkpoint(tiny_model, adapter_folder, reward_model, tmp_path):
    out = tmp_path / "eval"
    result = run_cli(
        "eval",
        adapter_folder,
        tiny_model,
        "--suite",
        "arithmetic",
        "--suite",
        "arithmetic-sycophancy",
        "--limit",
        "12",
        "--n",
        "4",
        "--k",
        "2",
        "--reward-model",
        reward_model,
        "--baseline",
        tiny_model,
        "--reference",
        tiny_model,
        "--out",
        out,
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())["checkpoints"]
    assert list(metrics) == [str(adapter_folder), str(tiny_model)]
    adapter = metrics[str(adapter_folder)]
    assert {
        "arithmetic/pass@1",
        "arithmetic/pass@2",
        "arithmetic/kl",
        "arithmetic/win_rate",
        "arithmetic/rm_score",
        "arithmetic-sycophancy/sycophancy",
        "arithmetic/reward_hacking",
    } <= set(adapter)
    assert adapter["arithmetic/kl"] > 0.05 and abs(metrics[str(tiny_model)]["arithmetic/kl"]) < 1e-4
    assert all(isinstance(v, float) for m in metrics.values() for v in m.values())
    report = (out / "report.md").read_text()
    assert "| arithmetic/win_rate |" in report and "**win_rate**" in report and "![metrics](metrics.png)" in report
    assert (out / "metrics.png").stat().st_size > 1000
    assert "arithmetic/pass@1" in result.stdout  # the rich table


def test_align_eval_user_errors(tiny_model, tmp_path):
    result = run_cli_here("eval", tiny_model, "--suite", "arithmetc", "--out", tmp_path)
    assert result.returncode == 2 and "did you mean 'arithmetic'" in result.stderr
    result = run_cli_here("eval", tmp_path / "missing", "--suite", "arithmetic", "--out", tmp_path)
    assert result.returncode == 2 and "does not exist" in result.stderr


def eval_recipe(tmp_path, evaluate: dict) -> dict:
    quick = {
        "max_steps": 4,
        "per_device_train_batch_size": 8,
        "learning_rate": 3.0e-3,
        "max_length": 32,
        "logging_steps": 1,
    }
    return {
        "name": "eval-test",
        "model": TINY_MODEL,
        "output_dir": str(tmp_path / "out"),
        "seed": 1,
        "stages": {
            "sft": {"data": {"task": "arithmetic", "n": 64}, "train": quick},
            "rm": {
                "kind": "reward",
                "model": "${sft}",
                "data": {"task": "arithmetic", "n": 64},
                "train": {**quick, "max_steps": 2},
            },
        },
        "evaluate": evaluate,
    }


EVALUATE_BLOCK = {
    "include_base": True,
    "suites": [
        {
            "name": "arithmetic",
            "data": {"task": "arithmetic", "split": "test", "n": 30},
            "verifier": "arithmetic",
            "sampling": {"temperature": 0, "max_new_tokens": 6},
            "pass_k": {"n": 4},
        },
        {
            "name": "sycophancy",
            "data": {"task": "arithmetic", "split": "test", "n": 30, "style": "sycophancy"},
            "verifier": "arithmetic",
            "sampling": {"temperature": 0, "max_new_tokens": 6},
        },
    ],
    "reward_model": "${rm}",
    "baseline": "sft",
    "reference": "sft",
}


def test_recipe_evaluate_block_writes_eval_folder(tmp_path):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe, run_recipe

    recipe = load_recipe(write_recipe(tmp_path, eval_recipe(tmp_path, EVALUATE_BLOCK)))
    check_recipe(recipe)
    run_recipe(recipe)
    folder = recipe.out / "eval"
    metrics = json.loads((folder / "metrics.json").read_text())["checkpoints"]
    assert list(metrics) == ["base", "sft"]  # the rm stage is a scorer, not a policy
    assert metrics["sft"]["arithmetic/win_rate"] == 0.5 and abs(metrics["sft"]["arithmetic/kl"]) < 1e-4
    assert {
        "arithmetic/pass@2",
        "arithmetic/pass@4",
        "sycophancy/sycophancy",
        "arithmetic/rm_score",
        "arithmetic/reward_hacking",
    } <= set(metrics["base"])
    assert {"metrics.json", "samples.jsonl", "report.md", "metrics.png", "curves_sft.png", "curves_rm.png"} <= {
        p.name for p in folder.iterdir()
    }
    assert "Baseline for win rate and reward hacking: `sft`" in (folder / "report.md").read_text()


@pytest.mark.parametrize(
    "evaluate, message",
    [
        ({**EVALUATE_BLOCK, "refrence": "sft"}, "did you mean 'reference'"),
        ({**EVALUATE_BLOCK, "baseline": "${sfft}"}, "did you mean 'sft'"),
        ({**EVALUATE_BLOCK, "reward_model": "${sft}"}, "must be a reward or dpo stage"),
        ({**EVALUATE_BLOCK, "reference": "rm"}, "must be a policy stage"),
        ({**EVALUATE_BLOCK, "after": ["sft", "rm"]}, "'rm', a reward model"),
        (
            {**EVALUATE_BLOCK, "suites": ["arithmetic", "arithmetic-sycophantic"]},
            "did you mean 'arithmetic-sycophancy'",
        ),
        (
            {**EVALUATE_BLOCK, "suites": [{**EVALUATE_BLOCK["suites"][0], "pass_k": {"n": 2, "k": [4]}}]},
            "between 1 and n",
        ),
    ],
)
def test_evaluate_block_errors_name_the_key(tmp_path, evaluate, message):
    from alignment.config.recipe import load_recipe

    with pytest.raises(UserError, match=message):
        load_recipe(write_recipe(tmp_path, eval_recipe(tmp_path, evaluate)))


def test_builtin_suite_names_in_a_recipe(tmp_path):
    from alignment.config.recipe import load_recipe

    recipe = load_recipe(
        write_recipe(tmp_path, eval_recipe(tmp_path, {"suites": ["arithmetic", "arithmetic-sycophancy"]}))
    )
    assert [s.name for s in recipe.evaluate.suites] == ["arithmetic", "arithmetic-sycophancy"]
    assert recipe.evaluate.suites[1].data.model_extra["style"] == "sycophancy"


def test_cli_suites_from_names_yaml_and_data_files(tmp_path):
    from alignment.config.evaluate import cli_suites

    (tmp_path / "suites.yaml").write_text(
        "- {name: mine, data: {task: arithmetic, split: test, n: 10}, verifier: arithmetic}\n"
        "- {name: rm-only, data: {dataset: prompts.jsonl}}\n"
    )
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "What is 1+2?", "answer": "3"}\n')
    suites, base_dir = cli_suites(
        ["arithmetic", str(tmp_path / "suites.yaml"), str(tmp_path / "prompts.jsonl")],
        verifier="numeric",
        n=4,
        k=[2],
        limit=5,
    )
    assert [s.name for s in suites] == ["arithmetic", "mine", "rm-only", "prompts"] and base_dir == tmp_path
    assert [s.verifier for s in suites] == ["arithmetic", "arithmetic", "numeric", "numeric"]
    assert all(s.pass_k.n == 4 and s.pass_k.k == [2] and s.data.limit == 5 for s in suites)
    with pytest.raises(UserError, match="between 1 and n"):
        cli_suites(["arithmetic"], n=2, k=[4])


def test_cli_sampling_overrides_reach_every_suite(tmp_path):
    """--max-new-tokens: main, pass@k (also one the suite file sets) and so KL; --temperature: main only."""
    from alignment.config.evaluate import cli_suites

    (tmp_path / "suites.yaml").write_text(
        "- {name: mine, data: {task: arithmetic, split: test, n: 10}, "
        "verifier: arithmetic, pass_k: {n: 4, max_new_tokens: 8, temperature: 0.8}}\n"
    )
    suites, _ = cli_suites(["arithmetic", str(tmp_path / "suites.yaml")], max_new_tokens=96, temperature=0.7)
    assert [(s.sampling.max_new_tokens, s.sampling.temperature) for s in suites] == [(96, 0.7), (96, 0.7)]
    assert suites[0].pass_k is None and (suites[1].pass_k.max_new_tokens, suites[1].pass_k.temperature) == (96, 0.8)
    untouched, _ = cli_suites(["arithmetic"])
    assert (untouched[0].sampling.max_new_tokens, untouched[0].sampling.temperature) == (16, 0.0)


def test_align_eval_passes_its_sampling_options_on(tiny_model, tmp_path, monkeypatch):
    from alignment.cli import main
    from alignment.evaluation import evaluate

    class Captured(Exception):
        pass

    def capture(paths, scoring, report, handoff=None):
        raise Captured(scoring.suites)

    monkeypatch.setattr(evaluate, "run_evaluation", capture)
    with pytest.raises(Captured) as caught:
        main(
            [
                "eval",
                str(tiny_model),
                "--suite",
                "arithmetic",
                "--n",
                "4",
                "--max-new-tokens",
                "48",
                "--temperature",
                "0.5",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
    suite = caught.value.args[0][0]
    assert (suite.sampling.max_new_tokens, suite.sampling.temperature) == (48, 0.5)
    assert (suite.pass_k.max_new_tokens, suite.pass_k.temperature) == (48, 1.0)


def test_a_suite_that_repeats_prompts_is_logged_with_its_distinct_count(logged):
    # One-digit sums: 100 problems, about 10 of them in the test band, so 40 test rows repeat them.
    data = {"task": "arithmetic", "split": "test", "n": 40, "digits": 1}
    (suite,) = load_suites([SuiteSpec(name="small", data=data, verifier="arithmetic")], 1, None)
    distinct = len(set(suite.prompts))
    assert distinct < 40
    assert f"[evaluate.suites.0 (small).data] 40 prompts, {distinct} distinct" in logged()
    load_suites([SuiteSpec(name="large", data={**data, "digits": 3}, verifier="arithmetic")], 1, None)
    assert "distinct" not in logged()  # 40 of about 81,000 three-digit sums: no repeat, nothing to say
