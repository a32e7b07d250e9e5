"""Hand-computed tests for `alignment.rl` (the arithmetic is written next to each expected value).

Run: python -m pytest tests/test_rl.py -q   (CPU, a few seconds)
"""

import json
import math
import statistics

import pytest
import torch

from alignment import rl

F32 = dict(dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    actual, expected = torch.as_tensor(actual, **F32), torch.as_tensor(expected, **F32)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------
# selective_log_softmax / entropy
# --------------------------------------------------------------------------------------------------


def naive_logprobs(logits, index):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, index[..., None]).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [1, 2, 512])
def test_selective_log_softmax_fp32_matches_log_softmax_and_grad(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    index = torch.randint(0, 11, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g)

    ours = rl.selective_log_softmax(logits, index, chunk_size=chunk_size)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    ref = naive_logprobs(logits, index)
    (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), logits)

    assert ours.shape == (3, 5) and ours.dtype == torch.float32
    close(ours, ref, atol=1e-6)
    close(grad_ours, grad_ref, atol=1e-6)


def test_selective_log_softmax_hand_value():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; log-probs [ln 1/4, ln 3/4] = [-1.386294, -0.287682]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    out = rl.selective_log_softmax(logits, torch.tensor([[0, 1]]))
    close(out, [[-1.386294, -0.287682]])


def test_selective_log_softmax_bf16_upcasts_and_accepts_non_contiguous():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(2, 7, 13, generator=g).to(torch.bfloat16).requires_grad_()
    logits = full[:, :-1]  # non-contiguous slice, as after the causal shift
    index = torch.randint(0, 13, (2, 6), generator=g)

    ours = rl.selective_log_softmax(logits, index, chunk_size=4)
    ref = naive_logprobs(logits, index)  # log_softmax of the same bf16 values, in fp32
    assert ours.dtype == torch.float32  # log-probs of bf16 logits come back in fp32
    close(ours, ref, atol=1e-5)

    (grad_ours,) = torch.autograd.grad(ours.sum(), full)
    (grad_ref,) = torch.autograd.grad(ref.sum(), full)
    assert grad_ours.dtype == torch.bfloat16
    close(grad_ours.float(), grad_ref.float(), atol=1e-2)


def test_selective_log_softmax_saves_no_fp32_copy_for_backward():
    # The memory contract: with bf16 logits [B, T, V], autograd must not keep an fp32 tensor of
    # B*T*V elements (plain log_softmax(logits.float()) would).
    logits = torch.randn(2, 3, 17).to(torch.bfloat16).requires_grad_()
    index = torch.zeros(2, 3, dtype=torch.long)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = rl.selective_log_softmax(logits, index, chunk_size=1)
        ent = rl.entropy_from_logits(logits, chunk_size=1)
    (out.sum() + ent.sum()).backward()
    assert not any(t.dtype == torch.float32 and t.numel() >= logits.numel() for t in saved)


def test_entropy_from_logits_values_and_grad():
    # Uniform over 4 tokens: H = ln 4 = 1.386294. Two tokens with p = [1/4, 3/4]:
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.346574 + 0.215762 = 0.562335.
    uniform = torch.zeros(1, 2, 4)
    close(rl.entropy_from_logits(uniform), [[1.386294, 1.386294]])
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    close(rl.entropy_from_logits(two), [[0.562335]])

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 9, generator=g, requires_grad=True)
    ours = rl.entropy_from_logits(logits, chunk_size=3)
    p = torch.softmax(logits, -1)
    ref = -(p * torch.log_softmax(logits, -1)).sum(-1)
    close(ours, ref, atol=1e-6)
    upstream = torch.randn(2, 5, generator=g)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), logits)
    close(grad_ours, grad_ref, atol=1e-6)

    bf16 = logits.detach().to(torch.bfloat16)
    assert rl.entropy_from_logits(bf16).dtype == torch.float32


# --------------------------------------------------------------------------------------------------
# sequence_logprobs on a tiny random Qwen2
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen2():
    """A tiny random Qwen2 in memory (the module itself; conftest's `tiny_model` is a saved checkpoint's path)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Qwen2ForCausalLM(config).eval()


def padded_batch():
    """Two rows: prompts (len 3, 5) left-padded to 5, completions (len 4, 2) right-padded to 4."""
    pad = 0
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    completions = [[31, 32, 33, 34], [41, 42]]
    ids, mask = [], []
    for p, c in zip(prompts, completions):
        left, right = 5 - len(p), 4 - len(c)
        ids.append([pad] * left + p + c + [pad] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
    return prompts, completions, torch.tensor(ids), torch.tensor(mask)


def naive_completion_logprobs(model, prompt, completion, temperature=1.0):
    # Unpadded single-sequence forward over the full vocab: the ground truth for one row.
    tokens = torch.tensor([prompt + completion])
    logits = model(input_ids=tokens).logits[0, :-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    return logps[-len(completion) :]


@pytest.mark.parametrize("temperature,batch_chunk_size", [(1.0, None), (0.7, 1)])
def test_sequence_logprobs_matches_unpadded_naive_forward(tiny_qwen2, temperature, batch_chunk_size):
    prompts, completions, ids, mask = padded_batch()
    with torch.no_grad():
        ours = rl.sequence_logprobs(
            tiny_qwen2, ids, mask, 4, temperature=temperature, batch_chunk_size=batch_chunk_size
        )
        assert ours.shape == (2, 4)
        for b, (p, c) in enumerate(zip(prompts, completions)):
            expected = naive_completion_logprobs(tiny_qwen2, p, c, temperature)
            close(ours[b, : len(c)], expected, atol=1e-5)


def test_sequence_logprobs_is_differentiable_and_validates(tiny_qwen2):
    _, _, ids, mask = padded_batch()
    out = rl.sequence_logprobs(tiny_qwen2, ids, mask, 4)
    out[mask[:, -4:].bool()].sum().backward()
    assert tiny_qwen2.lm_head.weight.grad is not None
    tiny_qwen2.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="num_logits_to_keep"):
        rl.sequence_logprobs(tiny_qwen2, ids, mask, ids.shape[1])


@pytest.mark.parametrize("batch_size", [1, 16])
def test_completion_logprob_sums_match_the_naive_forward_and_an_empty_completion_is_zero(tiny_qwen2, batch_size):
    prompts, completions, _, _ = padded_batch()
    sums = rl.completion_logprob_sums(
        tiny_qwen2, prompts + [[11, 12]], completions + [[]], pad=0, batch_size=batch_size
    )
    with torch.no_grad():
        expected = [float(naive_completion_logprobs(tiny_qwen2, p, c).sum()) for p, c in zip(prompts, completions)]
    assert sums == pytest.approx(expected + [0.0], abs=1e-5)


# --------------------------------------------------------------------------------------------------
# KL estimators and penalised rewards
# --------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    # d = logp - logp_ref in {0.5, -1, 0}
    logp = torch.tensor([[0.5, -1.0, 0.0]]) - 2.0
    ref = torch.tensor([[0.0, 0.0, 0.0]]) - 2.0
    close(rl.kl_estimate(logp, ref, "k1"), [[0.5, -1.0, 0.0]])
    # k2 = 0.5 d^2: 0.125, 0.5, 0
    close(rl.kl_estimate(logp, ref, "k2"), [[0.125, 0.5, 0.0]])
    # k3 = exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.606531 - 0.5 = 0.106531; e^1 - 2 = 0.718282; 0
    close(rl.kl_estimate(logp, ref, "k3"), [[0.106531, 0.718282, 0.0]])
    with pytest.raises(ValueError, match="k4"):
        rl.kl_estimate(logp, ref, "k4")


def test_k1_and_k3_expectations_equal_exact_kl():
    # Under samples from p, E_p[k1] = E_p[k3] = KL(p||q) exactly (E_p[q/p] = 1).
    # p = [.5,.3,.2], q = [.2,.3,.5]: KL = .5 ln 2.5 + .3 ln 1 + .2 ln .4 = 0.458145 - 0.183258 = 0.274887
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    for kind in ("k1", "k3"):
        close((p * rl.kl_estimate(p.log(), q.log(), kind)).sum(), 0.274887)


def test_penalized_rewards_places_score_at_last_real_token():
    scores = torch.tensor([2.0, -1.0, 3.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-1.0] * 4, [-3.0] * 4])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -0.1], [-1.0] * 4, [-1.0] * 4])
    rewards, kl = rl.penalized_rewards(scores, logp, ref, mask, kl_coef=0.1)
    # row 0: k1 = [0.5, -1.0, 0.0, (masked) 0]; r = -0.1 * k1 + [0, 0, 2.0, 0] = [-0.05, 0.1, 2.0, 0]
    # row 1: k1 = 0 everywhere; the score -1.0 lands on the last column (no padding)
    # row 2: all-zero mask: no score placed, no KL, nothing crashes
    close(kl, [[0.5, -1.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4])
    close(rewards, [[-0.05, 0.1, 2.0, 0.0], [0.0, 0.0, 0.0, -1.0], [0.0] * 4])

    # k3 on row 0: d = [0.5, -1.0, 0] -> [0.106531, 0.718282, 0]; r = -0.1 * that + score at t=2
    rewards3, kl3 = rl.penalized_rewards(scores[:1], logp[:1], ref[:1], mask[:1], 0.1, "k3")
    close(kl3, [[0.106531, 0.718282, 0.0, 0.0]])
    close(rewards3, [[-0.0106531, -0.0718282, 2.0, 0.0]])


def test_last_token_index():
    index, has = rl.last_token_index(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]))
    assert index.tolist() == [1, 3, 0] and has.tolist() == [True, True, False]


# --------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------


def test_masked_mean_var_whiten_ignore_masked_entries():
    # Unmasked entries {1, 3, 5, 7}; the 999s must not matter. mean = 16/4 = 4;
    # squared deviations 9, 1, 1, 9 (sum 20): biased var 20/4 = 5, unbiased 20/3 = 6.666667.
    x = torch.tensor([[1.0, 3.0, 999.0], [5.0, 7.0, -999.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    close(rl.masked_mean(x, mask), 4.0)
    close(rl.masked_mean(x, mask, dim=1), [2.0, 6.0])  # (1+3)/2, (5+7)/2
    close(rl.masked_var(x, mask, unbiased=False), 5.0)
    close(rl.masked_var(x, mask), 20.0 / 3.0, atol=1e-5)
    # whitened = (x - 4) / sqrt(20/3) = [-3, -1, 1, 3] / 2.581989 = [-1.161895, -0.387298, ...]
    # masked entries are set to 0
    close(rl.masked_whiten(x, mask), [[-1.161895, -0.387298, 0.0], [0.387298, 1.161895, 0.0]], atol=1e-5)
    # shift_mean=False adds the mean back: 4 + the above
    close(
        rl.masked_whiten(x, mask, shift_mean=False), [[2.838105, 3.612702, 0.0], [4.387298, 5.161895, 0.0]], atol=1e-5
    )


def test_masked_mean_empty_mask_is_zero_and_ignores_nan():
    x = torch.tensor([[float("nan"), 2.0]])
    close(rl.masked_mean(x, torch.tensor([[0, 1]])), 2.0)
    close(rl.masked_mean(x, torch.tensor([[0, 0]])), 0.0)
    with pytest.raises(ValueError, match="two or more"):
        rl.masked_var(x, torch.tensor([[0, 1]]))


def test_running_moments_hand_values():
    # 1, 2, 4: n = 3, mean = 7/3; m2 = (1 - 7/3)^2 + (2 - 7/3)^2 + (4 - 7/3)^2 = 16/9 + 1/9 + 25/9 = 14/3;
    # std = sqrt(m2 / (n - 1)) = sqrt(7/3). Step by step: after 1: mean 1, m2 0; after 2: delta 1, mean 3/2,
    # m2 = 1 * (2 - 3/2) = 1/2; after 4: delta 5/2, mean 3/2 + 5/6 = 7/3, m2 = 1/2 + 5/2 * (4 - 7/3) = 14/3.
    moments = rl.RunningMoments()
    assert (moments.count, moments.mean, moments.m2, moments.std) == (0.0, 0.0, 0.0, 0.0)
    moments.update([1.0])
    assert (moments.count, moments.mean, moments.m2, moments.std) == (1.0, 1.0, 0.0, 0.0)  # divisor at least 1
    moments.update([2.0])
    assert (moments.mean, moments.m2) == (1.5, 0.5)
    moments.update([4.0])
    assert moments.count == 3.0
    assert math.isclose(moments.mean, 7 / 3) and math.isclose(moments.m2, 14 / 3)
    assert math.isclose(moments.std, math.sqrt(7 / 3))


def test_running_moments_in_batches_equal_one_stream_and_state_round_trips():
    values = [0.5, -1.25, 3.0, 2.0, -0.75, 10.0]
    whole, parts = rl.RunningMoments(), rl.RunningMoments()
    whole.update(values)
    parts.update(values[:2])
    parts.update(values[2:])
    assert whole.state_dict() == parts.state_dict()  # the same bits: one value at a time, in order
    assert math.isclose(whole.std, statistics.stdev(values)) and math.isclose(whole.mean, statistics.fmean(values))
    state = json.loads(json.dumps(whole.state_dict()))
    assert list(state) == ["count", "mean", "m2"] and isinstance(state["count"], float)
    restored = rl.RunningMoments()
    restored.load_state_dict(state)
    restored.update([7.0])
    whole.update([7.0])
    assert restored.state_dict() == whole.state_dict()


# --------------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------------


def test_gae_gamma_one_lambda_095():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.8]])
    mask = torch.ones(1, 4)
    adv, ret = rl.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    # deltas (V after the last token = 0): t3 = 1 - 0.8 = 0.2; t2 = 0.8 - 0.7 = 0.1; t1 = t0 = 0.1
    # A3 = 0.2; A2 = 0.1 + 0.95*0.2 = 0.29; A1 = 0.1 + 0.95*0.29 = 0.3755;
    # A0 = 0.1 + 0.95*0.3755 = 0.456725.  Returns = A + V.
    close(adv, [[0.456725, 0.3755, 0.29, 0.2]])
    close(ret, [[0.956725, 0.9755, 0.99, 1.0]])


def test_gae_gamma_09_with_right_padding():
    # The padding column holds garbage (r=5, V=9) that must not leak in.
    rewards = torch.tensor([[0.1, -0.1, 1.0, 5.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = rl.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.95)
    # gamma*lam = 0.855. t3 masked: A3 = 0.
    # t2 (last real): delta = 1.0 + 0.9*0 - 3.0 = -2.0; A2 = -2.0
    # t1: delta = -0.1 + 0.9*3.0 - 2.0 = 0.6;  A1 = 0.6 + 0.855*(-2.0) = -1.11
    # t0: delta = 0.1 + 0.9*2.0 - 1.0 = 0.9;   A0 = 0.9 + 0.855*(-1.11) = -0.04905
    # returns = A + V = [0.95095, 0.89, 1.0, 0 (masked)]
    close(adv, [[-0.04905, -1.11, -2.0, 0.0]])
    close(ret, [[0.95095, 0.89, 1.0, 0.0]])


# --------------------------------------------------------------------------------------------------
# PPO losses
# --------------------------------------------------------------------------------------------------


def _policy(ratio, advantage, eps=0.2):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = rl.policy_loss(logp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), eps)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, stats, grad


@pytest.mark.parametrize(
    "ratio,advantage,loss,clipfrac,grad",
    [
        # A>0, r=1.5 > 1.2: max(-1.5, -1.2) = -1.2, clipped: no gradient
        (1.5, 1.0, -1.2, 1.0, 0.0),
        # A>0, r=0.5 < 0.8: max(-0.5, -0.8) = -0.5, unclipped: d(-A r)/dlogp = -A r = -0.5
        (0.5, 1.0, -0.5, 0.0, -0.5),
        # A<0, r=0.5 < 0.8: max(0.5, 0.8) = 0.8, clipped: no gradient
        (0.5, -1.0, 0.8, 1.0, 0.0),
        # A<0, r=1.5 > 1.2: max(1.5, 1.2) = 1.5, unclipped: -A r = 1.5
        (1.5, -1.0, 1.5, 0.0, 1.5),
        # inside the range, r=1.1, A=2: both terms -2.2, not counted as clipped; grad -2.2
        (1.1, 2.0, -2.2, 0.0, -2.2),
    ],
)
def test_policy_loss_clipping_cases(ratio, advantage, loss, clipfrac, grad):
    got_loss, stats, got_grad = _policy(ratio, advantage)
    close(got_loss, loss, atol=1e-6)
    close(stats["clipfrac"], clipfrac)
    close(got_grad, [[grad]], atol=1e-6)


def test_policy_loss_masked_mean_and_approx_kl():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1, 7.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # last token is padding with garbage
    loss, stats = rl.policy_loss(ratios.log(), torch.zeros(1, 6), adv, mask, 0.2)
    # per-token: -1.2, -0.5, 0.8, 1.5, -2.2 -> sum -1.6 / 5 = -0.32; clipped on tokens 0 and 2: 2/5
    close(loss, -0.32)
    close(stats["clipfrac"], 0.4)
    # approx_kl = k3 of KL(old||new) = r - 1 - ln r: single token r = 1.5 -> 0.5 - 0.405465 = 0.094535
    one_token = torch.ones(1, 1)
    _, one = rl.policy_loss(torch.tensor([[math.log(1.5)]]), 0 * one_token, one_token, one_token, 0.2)
    close(one["approx_kl"], 0.094535)


def test_value_loss_clipping():
    old = torch.ones(1, 4)
    values = torch.tensor([[1.5, 1.5, 1.1, 50.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = rl.value_loss(values, old, returns, mask, clip_range_value=0.2)
    # t0: (1.5-2)^2 = 0.25 vs clipped v=1.2: (1.2-2)^2 = 0.64 -> 0.64 (clipped branch active)
    # t1: (1.5-1)^2 = 0.25 vs (1.2-1)^2 = 0.04 -> 0.25
    # t2: v=1.1 inside [0.8, 1.2]: both (1.1-3)^2 = 3.61 -> 3.61
    # loss = 0.5 * (0.64 + 0.25 + 3.61) / 3 = 0.5 * 1.5 = 0.75; vf_clipfrac = 1/3
    close(loss, 0.75)
    close(stats["vf_clipfrac"], 1.0 / 3.0)
    (grad,) = torch.autograd.grad(loss, values)
    # d/dv of 0.5*mean: t0 clipped -> 0; t1 -> (1.5-1)/3 = 0.166667; t2 -> (1.1-3)/3 = -0.633333; pad 0
    close(grad, [[0.0, 0.166667, -0.633333, 0.0]], atol=1e-6)
    # no clipping: 0.5 * (0.25 + 0.25 + 3.61) / 3 = 0.685
    loss_none, stats_none = rl.value_loss(values, old, returns, mask, clip_range_value=None)
    close(loss_none, 0.685)
    close(stats_none["vf_clipfrac"], 0.0)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    close(rl.explained_variance(returns, returns, mask), 1.0)
    close(rl.explained_variance(torch.full_like(returns, 2.5), returns, mask), 0.0)
    # residual R - V = [0, 0, 0, -1]: mean -0.25, var = (3*0.0625 + 0.5625)/4 = 0.1875;
    # Var(R) = 1.25 -> 1 - 0.1875/1.25 = 0.85
    close(rl.explained_variance(torch.tensor([[1.0, 2.0, 3.0, 5.0, 0.0]]), returns, mask), 0.85)
    assert torch.isnan(rl.explained_variance(returns, torch.ones_like(returns), mask))


# --------------------------------------------------------------------------------------------------
# KL controllers
# --------------------------------------------------------------------------------------------------


def test_adaptive_kl_controller_updates():
    ctl = rl.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # 9/6 - 1 = 0.5 -> clipped to 0.2; mult = 1 + 0.2*1000/10000 = 1.02 -> 0.102
    ctl.update(9.0, n_steps=1000)
    close(ctl.value, 0.102)
    ctl = rl.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # 6.6/6 - 1 = 0.1 (inside the clip); mult = 1.01 -> 0.101
    ctl.update(6.6, 1000)
    close(ctl.value, 0.101)
    ctl = rl.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # 3/6 - 1 = -0.5 -> clipped to -0.2; mult = 0.98 -> 0.098
    ctl.update(3.0, 1000)
    close(ctl.value, 0.098)
    # then 5.4/6 - 1 = -0.1; mult = 1 - 0.1*500/10000 = 0.995 -> 0.098*0.995 = 0.09751
    ctl.update(torch.tensor(5.4), 500)
    close(ctl.value, 0.09751)
    ctl.update(float("nan"), 500)  # diverged step: unchanged
    close(ctl.value, 0.09751)


def test_fixed_controller_and_state_dict_roundtrip():
    fixed = rl.make_kl_controller(0.05)
    assert isinstance(fixed, rl.FixedKLController)
    for kl in (0.0, 100.0, -3.0):
        fixed.update(kl, 1000)
    assert fixed.value == 0.05

    adaptive = rl.make_kl_controller(0.2, target=1.0, horizon=100)
    assert isinstance(adaptive, rl.AdaptiveKLController)
    adaptive.update(2.0, 10)  # 0.2 * (1 + 0.2*10/100) = 0.204
    close(adaptive.value, 0.204)
    resumed = rl.make_kl_controller(0.2, target=1.0, horizon=100)
    resumed.load_state_dict(adaptive.state_dict())
    assert resumed.state_dict() == adaptive.state_dict()
    other = rl.FixedKLController(1.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05
    with pytest.raises(ValueError, match="target"):
        rl.AdaptiveKLController(0.1, target=0.0, horizon=10)
