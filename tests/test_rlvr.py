"""`rlvr` stage and the verifier -> TRL reward adapter (alignment/training/rewards.py).

Fast: the adapter on its own (columns, prompt, errors, logging), config validation, the batch /
num_generations check through `align check`, and the shipped real-model recipes (schema + TRL
config; no hub download). Slow: GRPO from the SFT fixture raises held-out accuracy; RLOO runs;
a custom `module:function` verifier next to the recipe drives a run; a verifier that raises on
some rows does not stop training.

    python -m pytest tests/test_rlvr.py -q -x
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from conftest import (
    REPO,
    SMALLEST_MODEL,
    heldout_accuracy,
    recipe_dict,
    run,
    run_cli_here,
    write_recipe,
)
from helpers import patch_everywhere

from alignment.errors import UserError

FAST_TRAIN = {
    "max_steps": 2,
    "num_generations": 4,
    "per_device_train_batch_size": 8,
    "max_completion_length": 6,
    "logging_steps": 1,
    "learning_rate": 1.0e-4,
}
FAST = {"data": {"task": "arithmetic", "split": "train", "n": 64}, "verifiers": ["arithmetic"], "train": FAST_TRAIN}


# ---------------------------------------------------------------------------------------------------
# The adapter


def test_adapter_strips_trl_kwargs_restores_prompt_and_logs(tmp_path):
    from alignment.training.rewards import SOURCE_PROMPT, VerifierReward
    from alignment.verifiers import resolve

    seen = []

    def check(completion, prompt, answer):
        seen.append((completion, prompt, answer))
        return None if completion == "?" else float(completion.strip() == answer)

    reward = VerifierReward(resolve(check), label="exact")
    logged = []
    out = reward(
        prompts=["<rendered>a", "<rendered>b", "<rendered>c"],
        completions=["1", "2", "?"],
        completion_ids=[[1], [2], [3]],
        trainer_state=object(),
        log_extra=lambda *a: None,
        log_metric=lambda name, value: logged.append((name, value)),
        answer=["1", "3", "4"],
        **{SOURCE_PROMPT: ["a", "b", "c"]},
    )
    assert out == [1.0, 0.0, 0.0] and all(isinstance(x, float) for x in out)
    assert seen == [("1", "a", "1"), ("2", "b", "3"), ("?", "c", "4")]  # the data's prompt, not the rendered one
    assert reward.__name__ == "exact"
    assert dict(logged) == {"unparseable/exact": pytest.approx(1 / 3), "errors/exact": 0.0}
    assert reward.totals()["verifier/exact/unparseable"] == 1


def test_adapter_scores_raising_rows_zero_and_counts_them(logged):
    from alignment.training.rewards import VerifierReward
    from alignment.verifiers import resolve

    def flaky(completion, answer):
        if answer == "boom":
            raise ZeroDivisionError("bad row")
        return 1.0

    reward = VerifierReward(resolve(flaky))
    out = reward(prompts=["p"] * 3, completions=["x", "y", "z"], answer=["1", "boom", "2"])
    assert out == [1.0, 0.0, 1.0]
    assert reward.totals()["verifier/flaky/errors"] == 1
    assert "ZeroDivisionError" in logged()


def test_adapter_missing_column_is_a_user_error():
    from alignment.training.rewards import VerifierReward
    from alignment.verifiers import resolve

    reward = VerifierReward(resolve("arithmetic"))
    with pytest.raises(UserError, match="answer"):
        reward(prompts=["p"], completions=["1"], other=["x"])


# ---------------------------------------------------------------------------------------------------
# Config and checks


def test_config_validation(tmp_path):
    from alignment.config.recipe import load_recipe

    numeric = {"name": "numeric", "weight": 0.5, "options": {"mode": "strict"}}
    good = recipe_dict(tmp_path, "rlvr", {**FAST, "verifiers": ["arithmetic", numeric]})
    stage = load_recipe(write_recipe(tmp_path, good)).stages["rlvr"]
    assert [v.name for v in stage.verifiers] == ["arithmetic", "numeric"] and stage.verifiers[1].weight == 0.5
    assert stage.algorithm == "grpo"
    for bad, message in [
        ({"verifiers": []}, "verifiers"),
        ({"algorithm": "ppo"}, "algorithm"),
        ({"gold": [{"nme": "arithmetic"}]}, "gold"),
        ({"verifier": ["arithmetic"]}, "verifier"),
    ]:
        with pytest.raises(UserError, match=message):
            load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", {**FAST, **bad})))


def test_kl_on_by_default_and_recipe_can_override(tmp_path):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import rlvr

    recipe = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", FAST)))
    args = rlvr.trl_config(make_context(recipe, "rlvr"))
    assert args.beta == rlvr.DEFAULT_BETA > 0
    assert args.reward_weights == [1.0]
    rloo = recipe_dict(tmp_path, "rlvr", {**FAST, "algorithm": "rloo", "train": {**FAST_TRAIN, "beta": 0.0}})
    recipe = load_recipe(write_recipe(tmp_path, rloo))
    args = rlvr.trl_config(make_context(recipe, "rlvr"))
    assert type(args).__name__ == "RLOOConfig" and args.beta == 0.0


def test_grpo_centres_a_reward_models_scores_without_scaling_them_unless_the_recipe_says(tmp_path):
    """With a reward model in the reward, GRPO's advantages are the group-centred rewards (`scale_rewards:
    none`): divided by the group's spread, GRPO on the quickstart's reward model gained -2.7 to +12 points over
    seeds 1-3, centred only +20.6 to +28 (docs/results.md). Verifiers alone keep TRL's default (`group`), and a
    recipe's own `scale_rewards` wins."""
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import rlvr

    def args_for(stage: dict, name: str):
        recipe = load_recipe(write_recipe(tmp_path / name, recipe_dict(tmp_path / name, "rlvr", {**FAST, **stage})))
        return rlvr.trl_config(make_context(recipe, "rlvr"))

    assert args_for({}, "verifiers").scale_rewards == "group"
    assert args_for({"verifiers": [], "reward_model": "rm"}, "rm").scale_rewards == "none"
    assert args_for({"reward_model": "rm"}, "both").scale_rewards == "none"
    assert (
        args_for({"reward_model": "rm", "train": {**FAST_TRAIN, "scale_rewards": "group"}}, "own").scale_rewards
        == "group"
    )


def test_check_rejects_batch_not_divisible_by_num_generations(tmp_path):
    recipe = recipe_dict(
        tmp_path, "rlvr", {**FAST, "train": {**FAST_TRAIN, "per_device_train_batch_size": 6, "num_generations": 4}}
    )
    done = run_cli_here("check", write_recipe(tmp_path, recipe))
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "num_generations=4" in message and "per_device_train_batch_size=6" in message
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("strategy", ["bucket_by_length", "group_by_length"])
def test_check_refuses_a_length_sampler_grpo_would_ignore(tmp_path, strategy):
    recipe = recipe_dict(tmp_path, "rlvr", {**FAST, "train": {**FAST_TRAIN, "train_sampling_strategy": strategy}})
    done = run_cli_here("check", write_recipe(tmp_path, recipe))
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert f"train.train_sampling_strategy: {strategy} is not supported here" in message
    assert "Traceback" not in done.stderr


def test_check_names_missing_verifier_column_and_unknown_verifier(tmp_path):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe

    no_answer = recipe_dict(tmp_path, "rlvr", {**FAST, "data": {"task": "arithmetic", "split": "train", "n": 16}})
    no_answer["stages"]["rlvr"]["data"]["rename"] = {"answer": "solution"}
    with pytest.raises(UserError, match="'answer'"):
        check_recipe(load_recipe(write_recipe(tmp_path, no_answer)))
    unknown = recipe_dict(tmp_path, "rlvr", {**FAST, "verifiers": ["arithmetc"]})
    with pytest.raises(UserError, match=r"verifiers\.0.*arithmetic"):
        check_recipe(load_recipe(write_recipe(tmp_path, unknown)))
    unknown_gold = recipe_dict(tmp_path, "rlvr", {**FAST, "gold": ["arithmetic", "arithmetc"]})
    with pytest.raises(UserError, match=r"stages\.rlvr\.gold\.1.*arithmetic"):
        check_recipe(load_recipe(write_recipe(tmp_path, unknown_gold)))


@pytest.mark.parametrize("stage", ["rlvr", "ppo", "evaluation"])
def test_prompt_data_errors_name_the_line_of_the_file_not_of_the_shuffled_order(tmp_path, stage):
    from alignment.config.evaluate import SuiteSpec
    from alignment.config.recipe import load_recipe
    from alignment.evaluation.evaluate import load_suites
    from alignment.run.runner import check_recipe

    rows = [{"messages": [{"role": "user", "content": f"What is {a}+1?"}], "answer": str(a + 1)} for a in range(30)]
    broken = {
        17: {"messages": rows[17]["messages"]},  # no answer: the verifier's column reads None in this row
        23: {"messages": [{"role": "user"}], "answer": "24"},
    }  # a message without content
    path = tmp_path / "prompts.jsonl"
    data = {"dataset": str(path), "limit": 25}  # shuffled (the default), then limited: rows 17 and 23 stay in
    if stage == "evaluation":

        def checked():
            load_suites([SuiteSpec(name="s", data=data, verifier="arithmetic")], 1, None)
    else:
        recipe = recipe_dict(tmp_path, "rlvr", {**FAST, "data": data})
        if stage == "ppo":
            recipe["stages"] = {"ppo": {"data": data, "verifiers": ["arithmetic"], "rollout": {"max_new_tokens": 4}}}
        loaded = load_recipe(write_recipe(tmp_path, recipe))

        def checked():
            check_recipe(loaded)

    for row, message in (
        (17, r"column 'answer', which verifier 'arithmetic' needs, is empty"),
        (23, r"a chat message is not \{'role': str, 'content': str\}"),
    ):
        written = [broken[row] if i == row else r for i, r in enumerate(rows)]
        path.write_text("".join(json.dumps(r) + "\n" for r in written))
        with pytest.raises(UserError, match=rf"line {row + 1} of \S*prompts.jsonl\W.*{message}"):
            checked()


def test_end_of_turn_token_stops_generation(tiny_model):
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.stages.rlvr import stop_at_end_of_turn

    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))
    model.generation_config.eos_token_id = 0  # a base model whose EOS is not the chat end-of-turn token
    stop_at_end_of_turn(model, tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|end|>") in model.generation_config.eos_token_id


def bos_adding_tokenizer():
    """The tiny tokenizer made to behave like Llama 3's: a BOS added on every call and opening the template."""
    from tokenizers.processors import TemplateProcessing

    from alignment.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<|begin|>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|begin|> $A", pair="<|begin|> $A $B", special_tokens=[("<|begin|>", bos)]
    )
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    return tokenizer


def test_prompts_reach_trl_with_one_bos_token():
    from alignment.data.formatting import render_prompt
    from alignment.models.tiny import build_tokenizer
    from alignment.stages.rlvr import without_leading_bos

    tokenizer = bos_adding_tokenizer()
    rendered = render_prompt(tokenizer, "What is 2+3?")
    assert tokenizer(rendered)["input_ids"].count(tokenizer.bos_token_id) == 2  # what TRL would have tokenized
    ids = tokenizer(without_leading_bos(tokenizer, rendered))["input_ids"]  # as TRL's GRPO tokenizes strings
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]  # one BOS, first, as the template puts it
    plain = build_tokenizer()  # adds nothing: the prompt is left alone
    assert without_leading_bos(plain, render_prompt(plain, "What is 2+3?")) == render_prompt(plain, "What is 2+3?")


def test_use_vllm_without_vllm_is_named_before_anything_loads(tmp_path, monkeypatch):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe

    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib then finds no vllm, installed or not
    recipe = load_recipe(
        write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", {**FAST, "train": {**FAST_TRAIN, "use_vllm": True}}))
    )
    with pytest.raises(UserError, match=r"(?s)stages.rlvr.train.use_vllm: vllm is not installed.*use_vllm: false"):
        check_recipe(recipe)


def test_vllm_sampling_is_told_the_end_of_turn_token(tmp_path, tiny_model, monkeypatch):
    from alignment.config import sampling
    from alignment.config.recipe import load_recipe
    from alignment.models.tokenizer import load_tokenizer
    from alignment.run.runner import make_context
    from alignment.stages import rlvr

    patch_everywhere(monkeypatch, sampling, "vllm_missing", lambda *_: None)  # as if installed
    tokenizer = load_tokenizer(str(tiny_model))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    for extra, expected in [({}, {end, tokenizer.eos_token_id}), ({"generation_kwargs": {"stop_token_ids": [7]}}, {7})]:
        # server mode: colocate mode is refused on CPU (the next test)
        train = {**FAST_TRAIN, "use_vllm": True, "vllm_mode": "server", **extra}
        recipe = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", {**FAST, "train": train})))
        args = rlvr.trl_config(make_context(recipe, "rlvr"))
        rlvr.stop_vllm_at_end_of_turn(args, tokenizer)
        assert set(args.generation_kwargs["stop_token_ids"]) == expected  # the recipe's own choice is kept


@pytest.mark.parametrize("mode", [{}, {"vllm_mode": "colocate"}])
def test_colocated_vllm_without_a_gpu_is_refused_with_the_reason(tmp_path, monkeypatch, mode):
    from alignment.config import sampling
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import check_recipe

    patch_everywhere(monkeypatch, sampling, "vllm_missing", lambda *_: None)  # as if installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = load_recipe(
        write_recipe(
            tmp_path, recipe_dict(tmp_path, "rlvr", {**FAST, "train": {**FAST_TRAIN, "use_vllm": True, **mode}})
        )
    )
    with pytest.raises(
        UserError,
        match=r"(?s)stages.rlvr.train.use_vllm: there is no CUDA GPU here.*colocate mode.*"
        r"sync_weights.*weight_loader.*use_vllm: false.*backend: vllm",
    ):
        check_recipe(recipe)


@pytest.mark.parametrize("name", ["gsm8k-grpo.yaml", "math-grpo.yaml"])
def test_shipped_rlvr_recipes_validate(name):
    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import rlvr
    from alignment.training.rewards import resolve_all

    recipe = load_recipe(REPO / "recipes" / "qwen2.5-0.5b" / name)
    ids = [s for s, c in recipe.stages.items() if c.kind == "rlvr"]
    assert ids
    for stage_id in ids:
        ctx = make_context(recipe, stage_id)
        args = rlvr.trl_config(ctx)
        assert args.beta > 0 and args.num_generations >= 2
        assert args.generation_batch_size % args.num_generations == 0
        resolve_all(ctx.config.verifiers, [recipe.base_dir], ctx.where)


# ---------------------------------------------------------------------------------------------------
# Training runs


def test_group_signal_counts_groups_without_reward_variance_from_the_weighted_verifier_rewards(logged):
    """Two verifiers, weights 1 and 0.5, groups of 2: a group is flat when its weighted totals are equal,
    whichever verifier differs; eval batches are logged, not counted; cut = the last id is no stop id."""
    from alignment.training.rewards import GroupSignal, VerifierReward
    from alignment.verifiers import resolve

    first = VerifierReward(resolve(lambda completion, a: float(a)), 1.0, "first")
    second = VerifierReward(resolve(lambda completion, b: float(b)), 0.5, "second")
    training = [True]
    signal = GroupSignal(
        [first, second], stop_ids=[9], num_generations=2, num_generations_eval=4, training=lambda: training[0]
    )
    shares = []

    def call(a, b, ids):
        for reward in (first, second):
            reward(
                prompts=["p"] * len(a),
                completions=["x"] * len(a),
                completion_ids=ids,
                a=a,
                b=b,
                log_metric=lambda name, value: shares.append((name, value)),
            )

    # totals [1, 1 | 1, 1.5 | 0.5, 0.5]: groups 1 and 3 are flat (group 1 though the verifiers differ)
    call(a=[1, 0, 1, 1, 0, 0], b=[0, 2, 0, 1, 1, 1], ids=[[1, 9], [2], [3, 9], [4, 9], [5], [6, 9]])
    shares = [(name, value) for name, value in shares if name.startswith("signal/")]
    assert shares == [("signal/zero_variance_groups", 2 / 3), ("signal/completions_truncated", 2 / 6)]
    training[0] = False  # an eval batch (groups of 4): logged, not counted
    call(a=[1, 1, 1, 1], b=[0, 0, 0, 0], ids=[[9]] * 4)
    shares = [(name, value) for name, value in shares if name.startswith("signal/")]
    assert shares[-2:] == [("signal/zero_variance_groups", 1.0), ("signal/completions_truncated", 0.0)]
    training[0] = True
    call(a=[1, 0], b=[0, 0], ids=[[9], [9]])
    assert signal.metrics() == {"zero_variance_groups": 0.5, "completions_truncated": 2, "completions_sampled": 8}
    signal.report("rl", max_completion_length=4)
    said = logged()
    assert "prompt groups" not in said  # half, not most
    assert "[rl] 2 of 8 completions (25%) were cut at max_completion_length=4" in said


@pytest.mark.parametrize("masked", [False, True])
def test_the_truncation_message_says_what_happened_to_the_cut_completions(logged, masked):
    """Cut completions are trained as cut off unless `mask_truncated_completions` is set; with it set, the message
    neither tells the user to set it nor says they were trained."""
    from alignment.training.rewards import GroupSignal, VerifierReward
    from alignment.verifiers import resolve

    reward = VerifierReward(resolve(lambda completion, a: float(a)), 1.0, "one")
    signal = GroupSignal([reward], stop_ids=[9], num_generations=2)
    reward(prompts=["p"] * 4, completions=["x"] * 4, completion_ids=[[9], [2], [9], [9]], a=[0, 1, 0, 1])
    signal.report("rl", max_completion_length=4, masked=masked)
    said = logged()
    assert "[rl] 1 of 4 completions (25%) were cut at max_completion_length=4" in said
    if masked:
        assert "left out of the loss (mask_truncated_completions: true)" in said
        assert "trained as cut off" not in said and "set train.mask_truncated_completions" not in said
    else:
        assert "trained as cut off" in said and "set train.mask_truncated_completions: true" in said


def test_group_signal_warns_when_most_groups_have_no_signal(logged, caplog):
    import logging

    from alignment.training.rewards import GroupSignal, VerifierReward
    from alignment.verifiers import resolve

    reward = VerifierReward(resolve(lambda completion: 1.0), 1.0, "one")
    signal = GroupSignal([reward], stop_ids=[9], num_generations=2)
    reward(prompts=["p"] * 4, completions=["x"] * 4, completion_ids=[[9]] * 4)
    signal.report("rl", max_completion_length=4)
    assert signal.metrics()["zero_variance_groups"] == 1.0
    assert [r.levelno for r in caplog.records if "prompt groups" in r.getMessage()] == [logging.WARNING]
    assert "[rl] 100% of prompt groups got the same reward" in logged()


# Flat within the group of a prompt with an even answer (its reward is the answer's length), varied otherwise;
# every reward is written down in call order, from which the test computes the true share of flat groups.
MIXED = """import pathlib

LOG = pathlib.Path(__file__).with_name("rewards.log")


def mixed(completion, answer):
    reward = float(len(answer)) if int(answer) % 2 == 0 else float(len(completion.strip()) % 3)
    with LOG.open("a") as log:
        log.write(f"{reward}\\n")
    return reward
"""


@pytest.mark.parametrize(
    "algorithm, train",
    [
        ("grpo", {"scale_rewards": "batch"}),  # TRL tests the batch's spread, not each group's
        ("rloo", {"beta": 0.04}),  # TRL tests the rewards after the KL penalty, which differs per completion
    ],
    ids=["grpo-batch-scaled", "rloo-with-kl"],
)
def test_groups_without_verifier_signal_are_counted_where_trls_number_misses_them(tmp_path, logged, algorithm, train):
    (tmp_path / "signal_verifiers.py").write_text(MIXED)
    steps = {
        **FAST_TRAIN,
        "max_steps": 3,
        "num_generations": 4,
        "per_device_train_batch_size": 16,
        "max_completion_length": 4,
        "learning_rate": 1.0e-2,
        **train,
    }
    stage = {
        **FAST,
        "algorithm": algorithm,
        "verifiers": ["signal_verifiers:mixed"],
        "train": steps,
        "data": {"task": "arithmetic", "split": "train", "n": 32},
    }
    _, result, history = run(tmp_path, "rlvr", stage, model=SMALLEST_MODEL)
    rewards = [float(line) for line in (tmp_path / "rewards.log").read_text().split()]
    groups = [rewards[i : i + 4] for i in range(0, len(rewards), 4)]
    truth = sum(len(set(g)) == 1 for g in groups) / len(groups)
    trl = [h["frac_reward_zero_std"] for h in history if "frac_reward_zero_std" in h]
    assert len(rewards) == 3 * 16 and 0 < truth < 1
    assert abs(sum(trl) / len(trl) - truth) > 0.1  # what TRL's number would have reported
    metrics = json.loads((tmp_path / "out" / "rlvr" / "stage.json").read_text())["metrics"]
    assert metrics["zero_variance_groups"] == pytest.approx(truth) == result["metrics"]["zero_variance_groups"]
    assert [h["signal/zero_variance_groups"] for h in history if "signal/zero_variance_groups" in h] == pytest.approx(
        [sum(len(set(g)) == 1 for g in groups[k : k + 4]) / 4 for k in (0, 4, 8)]
    )
    assert metrics["completions_sampled"] == 3 * 16
    assert 0 < metrics["completions_truncated"] <= 48 and metrics["prompts_over_context"] == 0
    assert "were cut at max_completion_length=4 tokens" in logged()


def test_a_run_whose_groups_all_got_equal_rewards_is_warned_about(tmp_path, logged):
    (tmp_path / "constant_reward.py").write_text("def always_one(completion):\n    return 1.0\n")
    train = {**FAST_TRAIN, "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4}
    _, result, _ = run(
        tmp_path,
        "rlvr",
        {
            **FAST,
            "verifiers": ["constant_reward:always_one"],
            "data": {"task": "arithmetic", "split": "train", "n": 8},
            "train": train,
        },
        model=SMALLEST_MODEL,
    )
    assert result["metrics"]["zero_variance_groups"] == 1.0
    text = logged()
    assert "[rlvr] 100% of prompt groups got the same reward" in text and "train.num_generations" in text


def test_prompts_that_do_not_fit_the_context_with_the_completions_are_counted(logged):
    from types import SimpleNamespace

    from alignment.stages.rlvr import prompts_over_context

    def tokenizer(text):  # one id per character
        return {"input_ids": list(text)}

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=20))
    args = SimpleNamespace(max_completion_length=8, use_vllm=False)
    rows = [{"prompt": "x" * n} for n in (5, 12, 13, 30)]
    assert prompts_over_context(rows, tokenizer, model, args, "stages.rl") == 2
    assert "[stages.rl] 2 of 4 prompts (50%) are longer than 12 tokens" in logged()
    vllm = SimpleNamespace(max_completion_length=8, use_vllm=True, vllm_max_model_length=40)
    assert prompts_over_context(rows, tokenizer, model, vllm, "stages.rl") == 0  # vLLM's own context applies


@pytest.mark.slow
def test_grpo_from_sft_checkpoint_keeps_accuracy_and_logs_kl(tmp_path, sft_checkpoint):
    """GRPO on arithmetic from the SFT fixture. Measured on 2 cores, it does NOT raise greedy held-out
    accuracy within a CPU-minutes budget (see the note at GRPO_ARITHMETIC); this guards against collapse."""
    from safetensors.torch import load_file

    stage = {
        "model": str(sft_checkpoint),
        "lora": None,
        "data": {"task": "arithmetic", "split": "train", "n": 2000},
        "train": GRPO_ARITHMETIC,
    }
    before = heldout_accuracy(sft_checkpoint)
    recipe, result, history = run(tmp_path, "rlvr", {**FAST, **stage})
    after = heldout_accuracy(recipe.stage_dir("rlvr"))
    assert result["metrics"]["kl"] > 0  # the KL term to the starting policy is on by default
    start = load_file(sft_checkpoint / "model.safetensors")
    end = load_file(recipe.stage_dir("rlvr") / "model.safetensors")
    assert any(not start[k].equal(end[k]) for k in start)
    assert after >= before - 0.05


@pytest.mark.slow
def test_rloo_runs_a_few_steps(tmp_path):
    recipe, result, history = run(tmp_path, "rlvr", {**FAST, "algorithm": "rloo"})
    assert result["metrics"]["global_step"] == FAST_TRAIN["max_steps"]
    assert any("rewards/arithmetic/mean" in h for h in history)
    assert (recipe.stage_dir("rlvr") / "model.safetensors").exists()


MY_VERIFIERS = '''
def lucky_seven(completion, *, digit="9"):
    """1.0 when the answer ends with `digit`, else 0.0; None when there is no answer."""
    text = completion.strip()
    return None if not text else float(text.endswith(digit))


def flaky(completion, answer):
    """Raises on every row whose answer is odd: those rows must score 0 and be counted."""
    if int(answer) % 2:
        raise ValueError("odd answer")
    return 1.0
'''


@pytest.mark.slow
def test_custom_verifier_next_to_recipe_drives_training(tmp_path, sft_checkpoint):
    """`my_verifiers:lucky_seven` (a file next to the recipe) rewards answers ending in 7: a behaviour
    the policy can learn in a few steps, so its logged reward must rise. The SFT fixture is sure of its answers
    (entropy ~0.15): 85-95% of its groups score alike and give GRPO nothing, so without `dynamic_sampling` twenty
    steps at 1e-3 moved the reward by +0.02 to +0.50 by seed (seeds 1-3, one thread, AMD EPYC with AVX-512); with
    flat groups dropped and refilled (up to three draws a batch) it rose by 0.20, 0.32 and 0.27 (first to last three
    logs; TRL logs every draw's rewards, so the rise is the policy's, not the selection's)."""
    (tmp_path / "my_verifiers.py").write_text(textwrap.dedent(MY_VERIFIERS))
    stage = {
        "model": str(sft_checkpoint),
        "lora": None,
        "data": {"task": "arithmetic", "split": "train", "n": 500},
        "verifiers": [{"name": "my_verifiers:lucky_seven", "options": {"digit": "7"}}],
        "dynamic_sampling": {"max_draws": 3},
        "train": {
            "max_steps": 20,
            "num_generations": 8,
            "per_device_train_batch_size": 64,
            "learning_rate": 1.0e-3,
            "max_completion_length": 8,
            "logging_steps": 2,
        },
    }
    _, result, history = run(tmp_path, "rlvr", {**FAST, **stage})
    key = "rewards/my_verifiers:lucky_seven/mean"  # TRL logs each reward function under its __name__
    means = [h[key] for h in history if key in h]
    metrics = result["metrics"]
    assert len(means) == 10 and metrics["dynamic_sampling/batches"] == 20
    assert metrics["verifier/my_verifiers:lucky_seven/scored"] == metrics["dynamic_sampling/draws"] * 64 > 20 * 64
    assert sum(means[-3:]) / 3 > sum(means[:3]) / 3 + 0.05


@pytest.mark.slow
def test_verifier_raising_on_some_rows_does_not_stop_training(tmp_path):
    (tmp_path / "my_verifiers.py").write_text(textwrap.dedent(MY_VERIFIERS))
    recipe, result, history = run(tmp_path, "rlvr", {**FAST, "verifiers": ["arithmetic", "my_verifiers:flaky"]})
    metrics = result["metrics"]
    assert (recipe.stage_dir("rlvr") / "stage.json").exists()
    assert 0 < metrics["verifier/my_verifiers:flaky/errors"] < metrics["verifier/my_verifiers:flaky/scored"]
    assert any(h.get("errors/my_verifiers:flaky", 0) > 0 for h in history)


# GRPO from the SFT fixture (held-out greedy accuracy, n=200): this config (full FT, lr 2e-5, 30 steps x 64
# completions) keeps it at 0.57 -> 0.55; higher learning rates or more steps lower it (lr 1e-4, 60 steps: 0.425).
# The fixture's errors are the units digit of 2-digit sums (about 10% right, near-uniform digits); plain SFT
# on 2000 ground-truth rows needs ~250 steps at batch 16 to fix them (0.57 -> 0.77), and GRPO's per-prompt
# signal is weaker and 8x costlier, so minutes of CPU are far too few for GRPO to raise greedy accuracy here.
# Where GRPO does gain in CPU minutes (the quickstart's weaker SFT, each sample batch serving several optimizer
# steps) tests/test_quickstart.py asserts it; docs/results.md has the figures.
GRPO_ARITHMETIC = {
    "max_steps": 30,
    "num_generations": 8,
    "per_device_train_batch_size": 64,
    "learning_rate": 2.0e-5,
    "max_completion_length": 8,
    "temperature": 1.0,
    "logging_steps": 5,
}


DIGITS = (
    "def digit_share(completion, **row):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"
)


def test_a_checkpoints_generation_config_does_not_change_what_rlvr_samples(tmp_path, tiny_model):
    """TRL fills every sampling field it leaves unset (min_p, min_new_tokens, ...) from the checkpoint's
    generation_config.json; the stage turns those defaults off, so a skewed checkpoint trains exactly like
    the clean one, and its saved checkpoint keeps its own config."""
    from helpers import with_skewed_generation_config
    from safetensors.torch import load_file

    weights, completions = {}, {}
    for name, model in (("clean", tiny_model), ("skewed", with_skewed_generation_config(tiny_model, tmp_path))):
        folder = tmp_path / f"run-{name}"
        folder.mkdir()
        (folder / "my_verifiers.py").write_text(DIGITS)
        recipe, _, history = run(folder, "rlvr", {**FAST, "verifiers": ["my_verifiers:digit_share"]}, model=str(model))
        weights[name] = load_file(str(recipe.stage_dir("rlvr") / "model.safetensors"))
        completions[name] = [(e.get("completions/mean_length"), e.get("reward")) for e in history if "reward" in e]
    assert completions["clean"] == completions["skewed"] and completions["clean"]
    assert all(torch.equal(weights["clean"][k], weights["skewed"][k]) for k in weights["clean"])
    saved = json.loads((tmp_path / "run-skewed" / "out" / "rlvr" / "generation_config.json").read_text())
    assert saved["min_p"] == 0.99


# ---------------------------------------------------------------------------------------------------
# Gold verifiers and a reward model as the reward


def test_gold_verifiers_are_logged_and_never_train(tmp_path):
    """`gold:` goes to TRL as a reward function of weight 0 whatever the recipe's weight: a run with a gold
    verifier of weight 1e6 trains to the same weights as one without, and logs gold/<name> every step."""
    from safetensors.torch import load_file

    runs = {}
    for name, stage in [("plain", {}), ("gold", {"gold": [{"name": "arithmetic", "weight": 1.0e6}]})]:
        recipe, _, history = run(tmp_path / name, "rlvr", {**FAST, **stage})
        runs[name] = (history, load_file(str(recipe.stage_dir("rlvr") / "model.safetensors")))
    (plain, weights), (logged, gold_weights) = runs["plain"], runs["gold"]
    assert weights.keys() == gold_weights.keys() and all(torch.equal(weights[k], gold_weights[k]) for k in weights)
    steps = [h for h in logged if "reward" in h]
    assert len(steps) == FAST_TRAIN["max_steps"] and all(0.0 <= h["gold/arithmetic"] <= 1.0 for h in steps)
    assert [h["reward"] for h in steps] == [h["reward"] for h in plain if "reward" in h]
    assert not any("gold/arithmetic" in h for h in plain)


def test_reward_model_reward_scores_the_rendered_conversation_as_ppo_does(tiny_model):
    """The reward model as a TRL reward function: the same score as `scoring.score_texts` (ppo's and rsft's) of
    the data's prompt and the completion; a completion cut before its end-of-turn token scores as sampled."""
    from transformers import AutoModelForSequenceClassification

    from alignment.data.formatting import render_prompt
    from alignment.models.tokenizer import load_tokenizer
    from alignment.training.rewards import SOURCE_PROMPT, RewardModelReward
    from alignment.training.scoring import score_texts

    tokenizer = load_tokenizer(str(tiny_model))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    sources, completions = ["What is 2+3?", "What is 40+2?"], ["5", "42"]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    reward = RewardModelReward(model, tokenizer, [end], weight=0.5)
    out = reward(
        prompts=[render_prompt(tokenizer, p) for p in sources],
        completions=completions,
        completion_ids=[ids[0] + [end], ids[1]],
        trainer_state=None,
        log_metric=lambda *a: None,
        answer=["5", "42"],
        **{SOURCE_PROMPT: sources},
    )
    assert out == score_texts(model, tokenizer, sources, completions, finished=[True, False])
    assert out[1] != score_texts(model, tokenizer, sources[1:], completions[1:])[0]  # cut != finished
    assert reward.__name__ == "reward_model" and reward.weight == 0.5


def test_reward_model_config(tmp_path):
    from alignment.config.recipe import load_recipe

    stage = {**FAST, "verifiers": [], "reward_model": "rm"}
    alone = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", stage)))
    assert alone.stages["rlvr"].reward_model == "rm" and alone.stages["rlvr"].verifiers == []
    for bad, message in [
        ({"verifiers": []}, "reward_model"),
        ({"reward_model_weight": 2.0}, "reward_model_weight"),
        ({"train": {**FAST["train"], "reward_weights": [1.0, 5.0]}}, "train.reward_weights"),
    ]:
        with pytest.raises(UserError, match=message):
            load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", {**FAST, **bad})))


def test_reward_model_with_verifiers_drives_a_run(tmp_path, tiny_model):
    """`reward_model:` with a verifier: TRL gets both, weighted (`reward_model_weight`), plus the gold verifier
    at weight 0; each is logged."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from alignment.config.recipe import load_recipe
    from alignment.run.runner import make_context
    from alignment.stages import rlvr

    rm_dir = tmp_path / "rm"
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model), num_labels=1)
    rm.config.pad_token_id = rm.config.pad_token_id or 0
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(rm_dir)
    stage = {"reward_model": str(rm_dir), "reward_model_weight": 0.5, "gold": ["arithmetic"]}
    recipe = load_recipe(
        write_recipe(tmp_path, recipe_dict(tmp_path, "rlvr", {**FAST, **stage}, model=str(tiny_model)))
    )
    assert rlvr.trl_config(make_context(recipe, "rlvr")).reward_weights == [1.0, 0.5, 0.0]
    _, result, history = run(tmp_path, "rlvr", {**FAST, **stage}, model=str(tiny_model))
    steps = [h for h in history if "reward" in h]
    assert all(k in steps[-1] for k in ("rewards/reward_model/mean", "rewards/arithmetic/mean", "gold/arithmetic"))
    assert result["metrics"]["global_step"] == FAST_TRAIN["max_steps"]
