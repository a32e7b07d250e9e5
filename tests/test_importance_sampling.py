"""Hand-computed tests for `alignment.rl.importance_weights` and how its weights enter a loss, plus an exact
check on a small categorical that a bf16-rounded sampler biases the policy gradient and the weights remove it.

Run: python -m pytest tests/test_importance_sampling.py -q   (CPU, a few seconds)
"""

import math

import pytest
import torch

from alignment import rl

NAN, INF = float("nan"), float("inf")


def close(actual, expected, atol=1e-6):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def weights_of(ratios, mask, **kwargs):
    """importance_weights with the sampler at log-prob 0, so the trainer's log-probs are the log-ratios."""
    trainer = torch.tensor(ratios, dtype=torch.float32).log()
    return rl.importance_weights(trainer, torch.zeros_like(trainer), torch.tensor(mask), **kwargs)


# --------------------------------------------------------------------------------------------------
# Hand values, token level
# --------------------------------------------------------------------------------------------------


def test_token_truncate_hand_values_and_mask():
    # ratios 1, 3, 0.5 and a padding token holding garbage (100); cap 2 -> w = min(r, 2) = 1, 2, 0.5, 0.
    w, stats = weights_of([[1.0, 3.0, 0.5, 100.0]], [[1, 1, 1, 0]], level="token", mode="truncate", cap=2.0)
    close(w, [[1.0, 2.0, 0.5, 0.0]])
    close(stats["is_ratio_mean"], 1.5)  # (1 + 3 + 0.5) / 3, the padding's 100 never enters
    close(stats["is_ratio_max"], 3.0)
    close(stats["is_clipped_frac"], 1 / 3)  # only r = 3 exceeds the cap
    close(stats["is_nonfinite_frac"], 0.0)
    # KL(sampler || trainer), k3 = r - 1 - ln r: 0, 2 - ln 3 = 0.901388, -0.5 + ln 2 = 0.193147 -> mean 0.364845
    close(stats["sampler_kl"], (0.0 + 0.901388 + 0.193147) / 3)
    close(
        stats["sampler_kl"],
        rl.masked_mean(
            rl.kl_estimate(torch.zeros(1, 4), w.new_tensor([[1.0, 3.0, 0.5, 100.0]]).log(), "k3"),
            torch.tensor([[1, 1, 1, 0]]),
        ),
    )


def test_token_mask_hand_values():
    # IcePop band [0.6, 2]: r = 1 kept, r = 3 above, r = 0.5 below -> w = 1, 0, 0; 2 of 3 masked.
    w, stats = weights_of([[1.0, 3.0, 0.5]], [[1, 1, 1]], level="token", mode="mask", cap=2.0, low=0.6)
    close(w, [[1.0, 0.0, 0.0]])
    close(stats["is_clipped_frac"], 2 / 3)
    close(stats["is_ratio_mean"], 1.5)  # the ratio statistics describe r before masking
    # low=None: only the upper bound masks -> r = 0.5 is kept with weight 0.5
    w, stats = weights_of([[1.0, 3.0, 0.5]], [[1, 1, 1]], level="token", mode="mask", cap=2.0)
    close(w, [[1.0, 0.0, 0.5]])
    close(stats["is_clipped_frac"], 1 / 3)


# --------------------------------------------------------------------------------------------------
# Hand values, sequence level
# --------------------------------------------------------------------------------------------------

SEQ_RATIOS = [[2.0, 1.5, 100.0], [0.5, 1.2, 1.0]]
SEQ_MASK = [[1, 1, 0], [1, 1, 1]]  # row 0's last token is padding with garbage


def test_sequence_truncate_hand_values():
    # row 0: 2 * 1.5 = 3 (the padding's 100 is not in the product); row 1: 0.5 * 1.2 * 1 = 0.6.
    # cap 2 -> row 0's tokens get min(3, 2) = 2, row 1's 0.6; padding 0.
    w, stats = weights_of(SEQ_RATIOS, SEQ_MASK, level="sequence", mode="truncate", cap=2.0)
    close(w, [[2.0, 2.0, 0.0], [0.6, 0.6, 0.6]])
    close(stats["is_ratio_mean"], (3 * 2 + 0.6 * 3) / 5)  # token-weighted: 7.8 / 5 = 1.56
    close(stats["is_ratio_max"], 3.0)
    close(stats["is_clipped_frac"], 2 / 5)  # row 0's two tokens


def test_sequence_mask_hand_values():
    # band [0.8, 4]: row 0 (3) kept whole, row 1 (0.6) masked whole -> 3 of 5 tokens masked.
    w, stats = weights_of(SEQ_RATIOS, SEQ_MASK, level="sequence", mode="mask", cap=4.0, low=0.8)
    close(w, [[3.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    close(stats["is_clipped_frac"], 3 / 5)


def test_sequence_ratio_in_log_space_does_not_overflow():
    # 200 tokens of ratio 2: the product 2**200 overflows fp32's exp (ln 2**200 = 138.6 > 88.7), the capped
    # weight does not.
    w, stats = weights_of([[2.0] * 200], [[1] * 200], level="sequence", mode="truncate", cap=5.0)
    close(w, torch.full((1, 200), 5.0))
    assert stats["is_clipped_frac"] == 1.0 and stats["is_ratio_max"] == INF
    w, _ = weights_of([[2.0] * 200], [[1] * 200], level="sequence", mode="mask", cap=5.0)
    close(w, torch.zeros(1, 200))


# --------------------------------------------------------------------------------------------------
# Non-finite log-probs, detaching, bad arguments
# --------------------------------------------------------------------------------------------------


def test_nonfinite_logprobs_get_weight_zero_and_are_counted():
    trainer = torch.tensor([[0.0, math.log(3.0), 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    sampler = torch.tensor([[0.0, 0.0, -INF, NAN], [math.log(0.5), 0.0, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # row 1's NaN sits on padding: ignored
    w, stats = rl.importance_weights(trainer, sampler, mask, level="token", mode="truncate", cap=2.0)
    close(w, [[1.0, 2.0, 0.0, 0.0], [2.0, 1.0, 1.0, 0.0]])
    close(stats["is_nonfinite_frac"], 2 / 7)
    # finite valid ratios: 1, 3, 2, 1, 1 -> mean 8 / 5, max 3; r > 2: only the 3 -> 1 / 7 of the valid tokens
    close(stats["is_ratio_mean"], 1.6)
    close(stats["is_ratio_max"], 3.0)
    close(stats["is_clipped_frac"], 1 / 7)
    assert all(torch.isfinite(v) for v in stats.values())
    # sequence level: a bad token zeroes its whole row; row 1's product is r = 2 * 1 * 1 (padding left out)
    w, stats = rl.importance_weights(trainer, sampler, mask, level="sequence", mode="truncate", cap=4.0)
    close(w, [[0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 0.0]])
    close(stats["is_nonfinite_frac"], 2 / 7)
    close(stats["is_ratio_mean"], 2.0)
    assert all(torch.isfinite(v) for v in stats.values())


def test_weights_are_detached_and_empty_mask_is_quiet():
    trainer = torch.tensor([[0.1, -0.2]], requires_grad=True)
    w, stats = rl.importance_weights(trainer, torch.zeros(1, 2), torch.ones(1, 2))
    assert not w.requires_grad and not any(v.requires_grad for v in stats.values())
    w, stats = rl.importance_weights(trainer, torch.zeros(1, 2), torch.zeros(1, 2))
    close(w, torch.zeros(1, 2))
    assert all(v == 0 for v in stats.values())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"level": "tokens"}, "level"),
        ({"mode": "clip"}, "mode"),
        ({"cap": 0.0}, "cap"),
        ({"mode": "truncate", "low": 0.5}, "low"),
        ({"mode": "mask", "cap": 2.0, "low": 3.0}, "low"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rl.importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="same"):
        rl.importance_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


# --------------------------------------------------------------------------------------------------
# How the weights enter a loss
# --------------------------------------------------------------------------------------------------


def test_policy_loss_weights_scale_each_token():
    # Per-token PPO terms (tests/test_rl.py): r = 1.5, A = 1 -> -1.2 (clipped); r = 0.5, A = 1 -> -0.5.
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], requires_grad=True)
    args = (logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 9.0]]), torch.tensor([[1, 1, 0]]), 0.2)
    plain, plain_stats = rl.policy_loss(*args)
    none, none_stats = rl.policy_loss(*args, weights=None)
    assert torch.equal(plain, none) and plain_stats.keys() == none_stats.keys()
    close(plain, (-1.2 - 0.5) / 2)
    # weights 2 and 0.5: (2 * -1.2 + 0.5 * -0.5) / 2 tokens = -1.325; the weights do not change the count
    loss, stats = rl.policy_loss(*args, weights=torch.tensor([[2.0, 0.5, 7.0]]))
    close(loss, -1.325)
    close(stats["clipfrac"], plain_stats["clipfrac"])
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, 0.5 * -0.5 / 2, 0.0]])  # clipped token: no gradient; the other d(-A r)/dlogp = -0.5


def test_weight_zero_silences_a_nonfinite_term():
    terms = torch.tensor([[1.0, NAN, INF]])
    close(rl.weighted_terms(terms, torch.tensor([[3.0, 0.0, 0.0]])), [[3.0, 0.0, 0.0]])
    loss, _ = rl.policy_loss(
        torch.tensor([[0.0, NAN]]),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        0.2,
        weights=torch.tensor([[1.0, 0.0]]),
    )
    close(loss, -0.5)  # token 0: -A * r = -1, token 1 silenced; mean over the 2 tokens


# --------------------------------------------------------------------------------------------------
# Exact check: a bf16 sampler biases the policy gradient, the importance weights remove the bias
# --------------------------------------------------------------------------------------------------

THETA = [0.3, -1.2, 0.7, 2.1, -0.4]
REWARD = [1.0, 0.3, 2.0, 0.5, -1.0]


def categorical():
    """Policy pi = softmax(theta) in fp64 (the trainer) and a sampler q = pi rounded through bf16 and renormalised."""
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    logpi = torch.log_softmax(theta, dim=0)
    q = logpi.detach().exp().to(torch.bfloat16).to(torch.float64)
    return theta, logpi, q / q.sum(), torch.tensor(REWARD, dtype=torch.float64)


def expected_gradient(theta, logpi, q, reward, weights):
    """E_{a ~ q}[w(a) r(a) grad log pi(a)] exactly: the sum over the actions of the surrogate's gradient."""
    (grad,) = torch.autograd.grad((q * weights * reward * logpi).sum(), theta, retain_graph=True)
    return grad


def is_weights(logpi, q, **kwargs):
    """One action per row ([A, 1]): the token-level weights of the trainer's log pi against the sampler's log q."""
    w, _ = rl.importance_weights(logpi.detach()[:, None], q.log()[:, None], torch.ones(len(q), 1), **kwargs)
    return w[:, 0]


def test_bf16_sampler_biases_the_gradient_and_importance_weights_remove_it():
    theta, logpi, q, reward = categorical()
    (true,) = torch.autograd.grad((logpi.exp() * reward).sum(), theta, retain_graph=True)  # grad E_pi[r]
    assert (q - logpi.detach().exp()).abs().max() > 1e-5  # the sampler really is mismatched

    uncorrected = expected_gradient(theta, logpi, q, reward, torch.ones_like(q))
    corrected = expected_gradient(theta, logpi, q, reward, is_weights(logpi, q, cap=1e6))
    bias = (uncorrected - true).abs().max()
    assert bias > 1e-4, bias
    close(corrected, true, atol=1e-6)
    close(corrected, true, atol=1e-12)  # exact up to fp64 rounding: q * pi / q = pi

    # Truncated at a cap that some ratio exceeds: biased again, but less, and within the bound
    # |E[(min(rho, c) - rho) r grad log pi]| <= sum_a q (rho - c)^+ |r| |grad log pi|.
    rho = logpi.detach().exp() / q
    cap = float(rho.max() + 1) / 2  # between 1 and the largest ratio
    assert rho.max() > cap
    truncated = expected_gradient(theta, logpi, q, reward, is_weights(logpi, q, cap=cap))
    jac = torch.autograd.functional.jacobian(lambda t: torch.log_softmax(t, 0), theta.detach())  # [A, A]
    bound = (q * (rho - cap).clamp(min=0) * reward.abs()) @ jac.abs()
    trunc_bias = (truncated - true).abs()
    assert (trunc_bias <= bound + 1e-15).all()
    assert trunc_bias.norm() < (uncorrected - true).norm()
    assert trunc_bias.max() > 1e-7  # truncation is a trade: some bias for bounded weights


def test_policy_loss_with_weights_gives_the_corrected_gradient():
    # PPO's loss at its first epoch (old = current, r = 1), A = reward, the mask holding the sampler's
    # probabilities: the masked mean is then the expectation under q, and its gradient is -E_q[w A grad log pi].
    theta, logpi, q, reward = categorical()
    (true,) = torch.autograd.grad((logpi.exp() * reward).sum(), theta, retain_graph=True)
    args = (logpi[:, None], logpi.detach()[:, None], reward[:, None], q[:, None], 0.2)
    loss, _ = rl.policy_loss(*args, weights=is_weights(logpi, q, cap=1e6)[:, None])
    (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
    close(-grad, true, atol=1e-6)
    loss, _ = rl.policy_loss(*args)
    (grad,) = torch.autograd.grad(loss, theta)
    assert (-grad - true).abs().max() > 1e-4


# --------------------------------------------------------------------------------------------------
# Wired into GRPO's loss (TRL's own `_compute_loss`) and PPO's loop
# --------------------------------------------------------------------------------------------------


def grpo_trainer(tiny_model, tmp_path):
    """A real TRL GRPOTrainer on the tiny model; the tests below replace its log-prob function by a categorical."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(THETA),
        num_generations=len(THETA),
        max_completion_length=1,
        loss_type="bnpo",
        beta=0.0,
        report_to="none",
        use_cpu=True,
    )
    return GRPOTrainer(
        model=load_policy(str(tiny_model)),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        processing_class=load_tokenizer(str(tiny_model)),
        train_dataset=datasets.Dataset.from_list([{"prompt": "1+1="}] * 4),
    )


def test_grpo_loss_with_the_sampler_correction_has_the_true_gradient(tiny_model, tmp_path):
    """TRL's GRPO loss (bnpo: sum of per-token terms x mask / sum of mask) on one completion token per row, row a
    being action a of the categorical with the mask holding the sampler's probability q(a): the loss is then
    -E_q[coef A] exactly, and its gradient at the first iteration (coef = 1) is -E_q[w A grad log pi]. With the
    stage's `SamplerCorrection` (w = pi/q) that is -grad E_pi[A]; without it, biased (the bf16 sampler above)."""
    from alignment.config.sampling import ImportanceSamplingSpec
    from alignment.stages.rlvr import SamplerCorrection

    theta, logpi, q, reward = categorical()
    (true,) = torch.autograd.grad((logpi.exp() * reward).sum(), theta, retain_graph=True)
    trainer = grpo_trainer(tiny_model, tmp_path)
    actions = len(THETA)

    def logps(_model, _ids, _attention, _keep, **_):  # the categorical as the trainer's per-token log-probs
        return torch.log_softmax(theta, dim=0).float()[:, None], torch.zeros(actions, 1), None

    trainer._get_per_token_logps_and_entropies = logps
    output = {
        "prompt_ids": torch.zeros(actions, 1, dtype=torch.long),
        "prompt_mask": torch.ones(actions, 1, dtype=torch.long),
        "completion_ids": torch.arange(actions)[:, None],
        "completion_mask": q.float()[:, None],
        "advantages": reward.float(),
        "num_items_in_batch": torch.tensor(1.0),
        "sampling_per_token_logps": q.log().float()[:, None],
    }
    trainer._generate_and_score_completions = lambda inputs: dict(output)  # the rollout, with the sampler's q
    correction = SamplerCorrection(trainer, ImportanceSamplingSpec(cap=1e6))
    gradients = {}
    for name, inputs in (("plain", dict(output)), ("corrected", correction([]))):
        loss = trainer._compute_loss(trainer.model, inputs)
        (gradients[name],) = torch.autograd.grad(loss, theta, retain_graph=True)
    close(-gradients["corrected"], true, atol=1e-6)  # fp32 log-probs: exact to fp32 rounding
    assert (-gradients["plain"] - true).abs().max() > 1e-4
    logged = trainer._metrics["train" if trainer.model.training else "eval"]
    assert logged["is_ratio_max"] and logged["sampler_kl"][-1] > 0 and logged["is_clipped_frac"] == [0.0]


def test_grpo_correction_leaves_a_batch_without_sampler_logprobs_and_counts_it(tiny_model, tmp_path):
    from alignment.config.sampling import ImportanceSamplingSpec
    from alignment.stages.rlvr import SamplerCorrection

    trainer = grpo_trainer(tiny_model, tmp_path)
    batch = {"advantages": torch.ones(2), "completion_mask": torch.ones(2, 1)}
    trainer._generate_and_score_completions = lambda inputs: batch
    correction = SamplerCorrection(trainer, ImportanceSamplingSpec())
    assert correction([]) is batch and correction.uncorrected == 1


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"importance_sampling": {"level": "word"}}, "level"),
        ({"importance_sampling": {"mode": "truncate", "low": 0.5}}, "lower bound of `mode: mask`"),
        ({"importance_sampling": {"cap": 0}}, "cap"),
        ({"importance_sampling": {}, "tools": None}, "TRL samples with the trained policy itself"),
        ({"importance_sampling": {}, "algorithm": "rloo", "tools": None}, "use algorithm: grpo"),
        ({"importance_sampling": {}, "train": {"top_p": 0.9}}, "before truncation"),
        ({"importance_sampling": {}, "train": {"use_vllm": True}}, "vllm_importance_sampling_mode"),
    ],
)
def test_rlvr_config_refuses_what_the_correction_cannot_do(stage, message):
    from pydantic import ValidationError

    from alignment.config.stages.rlvr import Config

    keys = {"data": {"task": "arithmetic", "n": 4}, "verifiers": ["arithmetic"], "tools": ["calculator"], **stage}
    keys = {k: v for k, v in keys.items() if v is not None}
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("`", ".")):
        Config(kind="rlvr", **keys)


def ppo_history(tmp_path, tiny_model, **ppo):
    import json

    from helpers import tiny_ppo_recipe, trainable_digest

    from alignment.config.recipe import load_recipe
    from alignment.run.runner import run_recipe

    path = tiny_ppo_recipe(tmp_path, tiny_model, **ppo)
    metrics = run_recipe(load_recipe(path))["ppo"]["metrics"]
    out = tmp_path / "out" / "ppo"
    stage = json.loads((out / "stage.json").read_text())
    history = json.loads((out / "log_history.json").read_text())
    return history, metrics, stage, trainable_digest(out / "model.safetensors")


def test_ppo_with_unit_weights_trains_exactly_as_without_the_correction(tmp_path, tiny_model, monkeypatch):
    """The wiring changes nothing but the weights: with the sampler's log-probs replaced by the trainer's own
    (every weight exactly 1), a run with `importance_sampling:` samples, trains and saves bit for bit as the
    default run (no key: today's loop, whose seeded figures tests/test_rollout.py holds)."""
    from alignment.stages import ppo

    plain, _, stage, plain_weights = ppo_history(tmp_path / "plain", tiny_model)
    assert stage["config"].get("importance_sampling") is None and "is_ratio_mean" not in plain[-1]
    exact = ppo.importance_weights
    monkeypatch.setattr(ppo, "importance_weights", lambda t, s, m, *a: exact(t, t, m, *a))
    weighted, _, _, weighted_weights = ppo_history(tmp_path / "is", tiny_model, importance_sampling={})
    assert [e["is_ratio_mean"] for e in weighted] == [1.0] * len(weighted)
    drop = lambda e: {k: v for k, v in e.items() if not k.startswith(("is_", "sampler_")) and k not in ppo.TIMING_KEYS}  # noqa: E731
    assert [drop(e) for e in weighted] == [drop(e) for e in plain]
    assert weighted_weights.keys() == plain_weights.keys()
    assert all(torch.equal(weighted_weights[k], plain_weights[k]) for k in plain_weights)


def test_ppo_with_top_k_logs_a_ratio_below_one_and_the_sampler_kl(tmp_path, tiny_model):
    """top-k sampling draws from pi / Z on the k kept tokens (Z < 1), so the ratio pi / pi_sampler of every sampled
    token is Z <= 1 and the sampler-trainer KL is positive: both logged per update and in stage.json."""
    history, metrics, stage, _ = ppo_history(
        tmp_path, tiny_model, rollout={"top_k": 3}, importance_sampling={"mode": "mask", "cap": 2.0, "low": 0.2}
    )
    for entry in history:
        assert 0 < entry["is_ratio_mean"] < 1 and entry["is_ratio_max"] <= 1 + 1e-5
        assert entry["sampler_kl"] > 0 and 0 <= entry["is_clipped_frac"] <= 1
    assert stage["metrics"]["sampler_kl"] == metrics["sampler_kl"] == history[-1]["sampler_kl"]


# --------------------------------------------------------------------------------------------------
# The samplers' processed log-probs (what the weights divide by)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_hf_sampler_records_the_processed_logprobs_it_drew_from(tiny_model, engine):
    """After temperature and top-k/top-p: the policy's log-softmax of the warped logits of each sampled token, above
    the untruncated log-probs (`Sample.logprobs`) wherever truncation removed mass; equal to them without it."""
    from alignment.config.sampling import SamplingSpec
    from alignment.data.formatting import encode
    from alignment.models.loading import load_policy
    from alignment.models.tokenizer import load_tokenizer
    from alignment.sampling import generate_ids
    from alignment.sampling.vllm_engine import mean_gap, policy_processed_logprobs

    tokenizer, model = load_tokenizer(str(tiny_model)), load_policy(str(tiny_model))
    prompts = [encode(tokenizer, p) for p in ("12+7=", "3+40=", "8+8=")]
    torch.manual_seed(0)
    for settings in (
        SamplingSpec(temperature=0.7, top_k=4, top_p=0.9, max_new_tokens=6, n=2, engine=engine),
        SamplingSpec(temperature=1.3, max_new_tokens=6, engine=engine),
    ):
        samples = generate_ids(model, tokenizer, prompts, settings, processed=True)
        assert all(len(s.processed_logprobs) == len(s.token_ids) == len(s.logprobs) for s in samples)
        with torch.no_grad():
            ours = policy_processed_logprobs(model, tokenizer, prompts, samples, settings)
        assert mean_gap(ours, [s.processed_logprobs for s in samples]) < 1e-5
        gaps = [p - r for s in samples for p, r in zip(s.processed_logprobs, s.logprobs)]
        if settings.top_k:
            assert min(gaps) >= -1e-6 and max(gaps) > 1e-3
        else:
            assert max(abs(g) for g in gaps) < 1e-6
