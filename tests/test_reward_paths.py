"""Reward paths that must not bend: reward-model ensembles combine standardised members, the DPO implicit reward
does not pay for not finishing, a KL estimator in the reward keeps the KL's gradient, and a checkpoint reloads
to the tokenizer it was trained with."""

from __future__ import annotations

import pytest
import torch

from alignment.config.model import TinySpec
from alignment.errors import UserError
from alignment.models.tiny import build_tiny_model, build_tokenizer
from alignment.models.tokenizer import load_tokenizer

PROBE = "What is 12*3? a b\n"


# --- a checkpoint reloads to the tokenizer it was trained with --------------------------------------------


def built_ids(text: str) -> list[int]:
    return build_tokenizer()(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tiny_model_reloads_to_the_tokenizer_it_was_built_with(tmp_path, arch):
    path = build_tiny_model(TinySpec(arch=arch, hidden_size=32, num_layers=1), seed=0, path=tmp_path / "model")
    tokenizer = load_tokenizer(str(path))
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == PROBE  # spaces and newlines kept (qwen2 once reloaded as "Whatis12*3?ab")
    assert ids == built_ids(PROBE)


def test_every_saved_checkpoint_reloads_to_its_tokenizer(tmp_path, tiny_model):
    from alignment.models.loading import load_policy
    from alignment.models.saving import export_plain_checkpoint, save_checkpoint

    tokenizer = load_tokenizer(str(tiny_model))
    save_checkpoint(load_policy(str(tiny_model)), tokenizer, tmp_path / "stage")
    export_plain_checkpoint(str(tmp_path / "stage"), tmp_path / "merged")
    for folder in (tiny_model, tmp_path / "stage", tmp_path / "merged"):
        reloaded = load_tokenizer(str(folder))
        assert reloaded(PROBE, add_special_tokens=False)["input_ids"] == built_ids(PROBE), folder


def test_a_checkpoint_whose_tokenizer_reloads_differently_is_refused(tmp_path, tiny_model, monkeypatch):
    """The loader that picked transformers' Qwen2 tokenizer for the tiny model (spaces dropped) stands in for any
    tokenizer that does not survive its save: the stage's checkpoint is refused, not marked finished."""
    from transformers import AutoTokenizer

    from alignment.models import tokenizer as tokenizer_module
    from alignment.models.loading import load_policy
    from alignment.models.saving import save_checkpoint

    tokenizer = load_tokenizer(str(tiny_model))
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda name, *a, **k: AutoTokenizer.from_pretrained(name))
    with pytest.raises(UserError, match="does not reload to the one the model was trained with"):
        save_checkpoint(load_policy(str(tiny_model)), tokenizer, tmp_path / "stage")


# --- the KL penalty in the reward keeps the KL's gradient --------------------------------------------------


def reward_path_gradients():
    """For a categorical policy pi = softmax(theta) and a reference, exactly (no sampling): the gradient of
    KL(pi || ref), of KL(ref || pi), and for each estimator k the gradient PPO follows when k is paid as a reward,
    E_pi[grad log pi * k] (k detached); with each estimator's expected value."""
    from alignment.rl import kl_estimate

    generator = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(6, generator=generator, dtype=torch.float64), 0)
    theta = (ref + 0.5 * torch.randn(6, generator=generator, dtype=torch.float64)).requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp()
    forward = torch.autograd.grad((p * (logp - ref)).sum(), theta, retain_graph=True)[0]
    reverse = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta, retain_graph=True)[0]
    value, paid = {}, {}
    for kind in ("k1", "k2", "k3"):
        estimate = kl_estimate(logp.detach(), ref, kind)
        value[kind] = float((p.detach() * estimate).sum())
        paid[kind] = torch.autograd.grad((p.detach() * logp * estimate).sum(), theta, retain_graph=True)[0]
    return float((p * (logp - ref)).sum()), forward, reverse, value, paid


def test_only_k1_paid_as_a_reward_follows_the_kl_gradient():
    kl, forward, reverse, value, paid = reward_path_gradients()
    assert value["k1"] == pytest.approx(kl) and value["k3"] == pytest.approx(kl)  # both unbiased in value
    assert torch.allclose(paid["k1"], forward)  # and k1 in gradient
    assert torch.allclose(paid["k3"], forward - reverse)  # k3: the two directions' gradients cancel near ref
    for kind in ("k2", "k3"):
        assert (paid[kind] - forward).norm() > 0.5 * forward.norm()


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_k2_and_k3_are_refused_in_the_reward(kind):
    from alignment.config.stages.ppo import Config

    with pytest.raises(ValueError, match=f"{kind} is refused in the reward.*k1"):
        Config(reward_model="rm", data={"task": "arithmetic", "n": 4}, kl_estimator=kind)
    assert Config(reward_model="rm", data={"task": "arithmetic", "n": 4}).kl_estimator == "k1"


# --- reward-model ensembles combine standardised members ---------------------------------------------------

OFFSETS = [0.0, 0.8, -0.8]


def offset_members(scores: torch.Tensor) -> torch.Tensor:
    """Three members that rank every answer alike and differ by a Bradley-Terry offset each: [3, n]."""
    return torch.stack([scores + offset for offset in OFFSETS])


def test_min_and_uwo_do_not_follow_a_members_offset():
    from alignment.models.reward_ensemble import combine_scores, member_statistics

    reference = offset_members(torch.tensor([-1.0, 0.5, 2.0, 0.0, 1.5], dtype=torch.float64))  # the stage's pairs
    stats = member_statistics(reference.tolist())
    answers = offset_members(torch.tensor([0.3, -0.4, 1.2], dtype=torch.float64)).requires_grad_(True)
    for combine in ("min", "uwo"):
        combined = combine_scores(answers, combine, penalty=1.0, standardisation=stats)
        assert combined.tolist() == pytest.approx(answers[0].tolist())  # the members agree: one member's score
        weights = torch.autograd.grad(combined.sum(), answers)[0][:, 0]
        assert (weights >= 0).all(), (combine, weights)  # no member is paid to be lowered
    uwo = combine_scores(answers, "uwo", penalty=1.0, standardisation=stats)
    assert torch.autograd.grad(uwo.sum(), answers)[0][:, 0].tolist() == pytest.approx([1 / 3] * 3)
    assert combine_scores(answers, "mean").tolist() == pytest.approx(answers[0].tolist())  # mean: as it was


def test_an_ensemble_folder_without_statistics_loads_with_mean_and_is_refused_with_min(tmp_path, tiny_model):
    import json

    from transformers import AutoModelForSequenceClassification

    from alignment.models.loading import load_reward_model
    from alignment.models.reward_ensemble import RewardEnsemble
    from alignment.training.scoring import check_reward_model

    folder = tmp_path / "rm"
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    for path in (folder, folder / "members" / "1"):
        classifier.save_pretrained(path)
        load_tokenizer(str(tiny_model)).save_pretrained(path)
    for combine in ("mean", "min", "uwo"):  # the marker an older reward stage wrote
        (folder / "reward_ensemble.json").write_text(
            json.dumps({"members": [".", "members/1"], "combine": combine, "penalty": 1.0})
        )
        if combine == "mean":
            assert isinstance(load_reward_model(str(folder)), RewardEnsemble)
            continue
        with pytest.raises(
            UserError, match=f"combines its members with {combine} but was written without .*reward stage again"
        ):
            load_reward_model(str(folder))
        with pytest.raises(UserError, match="written without"):
            check_reward_model("${rm}", str(folder), "stages.ppo.reward_model")


# --- the DPO implicit reward does not pay for not finishing ------------------------------------------------

BETA = 0.1
QUESTION = "What is 37+48?"
ANSWERS = ["85", "85 85", "85 85 85 85", "8", "85 is it", "84", "75 85", "1 2 3", "85 and 85", "ok"]


@pytest.fixture(scope="module")
def implicit(tiny_model):
    """A DPO-like policy (the tiny model with every weight nudged) read as an implicit reward against the tiny
    model, and the tokenizer."""
    from alignment.models.implicit_reward import ImplicitRewardModel
    from alignment.models.loading import load_policy

    policy = load_policy(str(tiny_model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return ImplicitRewardModel(policy, load_policy(str(tiny_model)), BETA), load_tokenizer(str(tiny_model))


def test_an_unfinished_answer_never_scores_above_the_same_answer_finished(implicit):
    from alignment.training.scoring import score_texts

    judge, tokenizer = implicit
    prompts = [QUESTION] * len(ANSWERS)
    finished = score_texts(judge, tokenizer, prompts, ANSWERS, finished=[True] * len(ANSWERS))
    cut = score_texts(judge, tokenizer, prompts, ANSWERS, finished=[False] * len(ANSWERS))
    as_sampled = [
        judge.score(*map(list, zip(*[encoded(tokenizer, a, False)])), tokenizer.pad_token_id)[0] for a in ANSWERS
    ]
    paid = [i for i in range(len(ANSWERS)) if as_sampled[i] > finished[i] + 1e-6]
    assert paid, "the perturbed policy lowers the end of turn after none of the answers: the test shows nothing"
    for i in range(len(ANSWERS)):  # min(as sampled, finished): skipping the end-of-turn term never pays
        assert cut[i] == pytest.approx(min(as_sampled[i], finished[i]), abs=1e-5), ANSWERS[i]
        assert cut[i] <= finished[i] + 1e-5 and cut[i] <= as_sampled[i] + 1e-5


def encoded(tokenizer, answer: str, done: bool) -> tuple[list[int], list[int]]:
    from alignment.data.formatting import encode_prompt_completion, render_completion, render_prompt

    text = render_completion(tokenizer, QUESTION, answer) if done else answer
    return encode_prompt_completion(tokenizer, render_prompt(tokenizer, QUESTION), text)


def ppo_returns(judge, tokenizer, answers: list[str], done: list[bool], kl_coef: float) -> list[float]:
    """Each sample's PPO return (score at the last token, minus kl_coef x the k1 KL on every token) with the
    DPO policy itself as PPO's policy: the sampled ids end with the end of turn where the sample finished."""
    from alignment.rl import penalized_rewards, prompt_completion_batch, sequence_logprobs
    from alignment.training.scoring import score_texts

    scores = torch.tensor(score_texts(judge, tokenizer, [QUESTION] * len(answers), answers, finished=done))
    rows = [encoded(tokenizer, a, d) for a, d in zip(answers, done)]
    ids, attention, mask = prompt_completion_batch([p for p, _ in rows], [c for _, c in rows], tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = sequence_logprobs(judge.policy, ids, attention, mask.shape[1])
        ref_logprobs = sequence_logprobs(judge.reference, ids, attention, mask.shape[1])
    rewards, _ = penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef)
    return rewards.sum(1).tolist()


def test_ppo_on_an_implicit_reward_does_not_gain_by_length_or_by_not_finishing(implicit):
    """At kl_coef = beta the DPO policy is PPO's optimum: every finished sample's return is 0 whatever its
    length, and a cut-off one's is min(0, beta x the end of turn's log-ratio), never above a finished one's."""
    judge, tokenizer = implicit
    short, long = ANSWERS[0], ANSWERS[2]
    returns = ppo_returns(judge, tokenizer, [short, long, long, "85 85 85 85 85 85"], [True, True, False, False], BETA)
    assert returns[:2] == pytest.approx([0.0, 0.0], abs=1e-4)
    assert max(returns[2:]) <= 1e-4
    below = ppo_returns(judge, tokenizer, [short, long], [True, True], BETA / 2)
    assert below != pytest.approx([0.0, 0.0], abs=1e-4)  # below beta the log-ratio itself pays (the warning's case)


def test_ppo_says_when_kl_coef_is_below_the_implicit_rewards_beta(tmp_path, tiny_model, implicit, logged):
    from conftest import recipe_dict, write_recipe

    from alignment.config.recipe import load_recipe
    from alignment.models.implicit_reward import write_marker
    from alignment.run.runner import make_context
    from alignment.stages.ppo import Scorer

    judge, tokenizer = implicit
    dpo = tmp_path / "dpo"
    judge.policy.save_pretrained(dpo)
    tokenizer.save_pretrained(dpo)
    write_marker(dpo, str(tiny_model), BETA)
    for kl, target, warned in [(BETA / 2, None, True), (BETA, None, False), (BETA, 0.5, True), (2 * BETA, None, False)]:
        stage = {
            "policy": str(tiny_model),
            "reward_model": str(dpo),
            "data": {"task": "arithmetic", "n": 4},
            "kl_coef": kl,
            "kl_target": target,
            "rollout": {"batch_size": 4},
            "train": {"mini_batch_size": 4},
        }
        recipe = load_recipe(write_recipe(tmp_path, recipe_dict(tmp_path, "ppo", stage, str(tiny_model))))
        Scorer(make_context(recipe, "ppo"), "cpu")
        said = logged()
        assert ("past the DPO policy" in said) == warned, (kl, target, said)
        if warned:
            assert (f"kl_coef {kl:g} is below the implicit reward's beta {BETA:g}" in said) == (target is None)
