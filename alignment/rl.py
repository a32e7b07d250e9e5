"""Pure tensor functions for our PPO loop (InstructGPT / Ziegler et al. 2019 formulation), each free of
training-loop state and unit-tested on hand-computed values (tests/test_rl.py): log-probs and entropy without
an fp32 [B, T, V] copy of the logits; KL estimators k1/k2/k3 and the KL-penalised per-token reward; masked
statistics, running moments of a stream of scores, GAE; the clipped PPO policy and value losses; fixed and
adaptive KL-coefficient controllers (with `state_dict()` for resume); importance weights for a mismatched sampler.

Conventions shared by every function (other code relies on them):
- B = batch, T = completion length, V = vocab. Completions are right-padded; `mask` is [B, T] with
  1 for real completion tokens (up to and including EOS) and 0 for padding after them.
- Log-probs are natural-log, per token, fp32 whenever the logits were bf16/fp16.
- Everything that returns [B, T] holds 0 at masked positions (KL, rewards, advantages, returns,
  whitened values), so a forgotten mask cannot leak padding into a sum.
- Losses are to be *minimised*; stats are detached 0-dim tensors (call `.item()` to log).
"""

from __future__ import annotations

import math

import torch

# Tokens per chunk when a [B, T, V] tensor is reduced to [B, T]: one fp32 chunk of a 152k vocabulary holds
# 512 x 152k x 4 bytes, small next to the model, and few enough chunks that Python overhead is negligible.
DEFAULT_CHUNK_TOKENS = 512

_KL_KINDS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------------------------------
# Log-probs and entropy without an fp32 [B, T, V] copy
# ---------------------------------------------------------------------------------------------------


def _row_chunks(logits: torch.Tensor, chunk_size: int):
    """Yield (b, slice, x): x = logits[b, slice] ([<=chunk_size, V]), upcast to fp32 if half.

    Going row by row (then over T) never reshapes `logits`, so a non-contiguous slice such as
    `logits[:, :-1]` is not copied either.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits of shape [B, T, V], got {tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, _ = logits.shape
    for b in range(batch):
        for start in range(0, length, chunk_size):
            sl = slice(start, min(start + chunk_size, length))
            x = logits[b, sl]
            yield b, sl, (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x)


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for half logits (log-prob differences feed exp() in the PPO ratio), else unchanged."""
    return torch.promote_types(logits.dtype, torch.float32)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Chunked `log_softmax(logits).gather(index)` whose backward recomputes the softmax per chunk.

    Plain autograd would save every fp32 chunk for backward, i.e. the whole fp32 [B, T, V] copy we
    avoid; here only the original `logits` (model dtype) and `index` are saved.
    d logp_y / d x_j = 1[j = y] - softmax(x)_j.
    """

    @staticmethod
    def forward(ctx, logits, index, chunk_size):
        out = logits.new_empty(index.shape, dtype=_out_dtype(logits))
        for b, sl, x in _row_chunks(logits, chunk_size):
            picked = x.gather(-1, index[b, sl, None]).squeeze(-1)
            out[b, sl] = picked - torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, index)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, index = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for b, sl, x in _row_chunks(logits, ctx.chunk_size):
            g = grad_out[b, sl, None].to(x.dtype)
            d = torch.softmax(x, dim=-1).mul_(-g)
            d.scatter_add_(-1, index[b, sl, None], g)
            grad[b, sl] = d
        return grad, None, None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """Log-probability of the chosen tokens: `log_softmax(logits, -1).gather(-1, index)`.

    Shapes: logits [B, T, V], index [B, T] (int) -> [B, T]; dtype fp32 for bf16/fp16 logits,
    otherwise the logits' dtype. Equation: logp_t = logits[t, y_t] - logsumexp_v logits[t, v].
    Computed `chunk_size` tokens at a time (upcast per chunk), so neither the forward nor the
    backward ever holds an fp32 [B, T, V] tensor. Differentiable once (no double backward).
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index shape {tuple(index.shape)} must equal logits shape[:-1] {tuple(logits.shape[:-1])}")
    return _SelectiveLogSoftmax.apply(logits, index.long(), chunk_size)


class _Entropy(torch.autograd.Function):
    """Chunked entropy with a recomputing backward (same memory argument as above).

    H = -sum_j p_j log p_j, and dH/dx_j = -p_j (log p_j + H).
    """

    @staticmethod
    def forward(ctx, logits, chunk_size):
        out = logits.new_empty(logits.shape[:-1], dtype=_out_dtype(logits))
        for b, sl, x in _row_chunks(logits, chunk_size):
            logp = torch.log_softmax(x, dim=-1)
            out[b, sl] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, out)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for b, sl, x in _row_chunks(logits, ctx.chunk_size):
            logp = torch.log_softmax(x, dim=-1)
            h = entropy[b, sl, None].to(x.dtype)
            g = grad_out[b, sl, None].to(x.dtype)
            grad[b, sl] = -logp.exp() * (logp + h) * g
        return grad, None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Entropy of the categorical distribution at each position.

    Shapes: logits [B, T, V] -> [B, T] (fp32 for half logits). Equation: H_t = -sum_v p_tv log p_tv,
    p = softmax(logits). Chunked like `selective_log_softmax`; differentiable once, so it can back an
    entropy bonus as well as logging.
    """
    return _Entropy.apply(logits, chunk_size)


def prompt_completion_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], pad: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout `sequence_logprobs` reads: ids [B, P + K] with prompts left-padded (as generated) and
    completions right-padded, their attention mask, and the completion mask [B, K] (float)."""
    width, k = max(map(len, prompt_ids)), max(map(len, completion_ids))
    ids, attention, mask = [], [], []
    for p, c in zip(prompt_ids, completion_ids):
        ids.append([pad] * (width - len(p)) + p + c + [pad] * (k - len(c)))
        attention.append([0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (k - len(c)))
        mask.append([1] * len(c) + [0] * (k - len(c)))
    return (
        torch.tensor(ids, device=device),
        torch.tensor(attention, device=device),
        torch.tensor(mask, device=device, dtype=torch.float),
    )


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_logits_to_keep: int,
    temperature: float = 1.0,
    batch_chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs of the last `num_logits_to_keep` tokens of `input_ids` under `model`.

    Shapes: input_ids, attention_mask [B, L] (prompt left-padded, completion right-padded, the
    completion = the last K = num_logits_to_keep columns) -> [B, K]; out[b, t] =
    log softmax(logits[b, L-K-1+t] / temperature)[input_ids[b, L-K+t]] (logits shifted by one).
    Padding columns get a value too: mask them with the completion mask.
    `batch_chunk_size` rows per forward (None = all); `logits_to_keep=K+1` skips the lm_head on the
    prompt, so at most a [chunk, K+1, V] tensor in the model's dtype exists at a time.
    """
    batch, length = input_ids.shape
    k = int(num_logits_to_keep)
    if not 1 <= k < length:
        raise ValueError(f"num_logits_to_keep must be in [1, {length - 1}] for sequences of length {length}, got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # Position ids as `generate` builds them (cumsum of the mask), so left padding does not shift
    # positions and the log-probs match the distribution the tokens were sampled from.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    step = batch if batch_chunk_size is None else int(batch_chunk_size)
    parts = []
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        out = model(
            input_ids=input_ids[rows],
            attention_mask=attention_mask[rows],
            position_ids=position_ids[rows],
            logits_to_keep=k + 1,
            use_cache=False,
        )
        # Slice again in case a model ignores logits_to_keep; drop the last logit (it predicts
        # the token after the sequence). Sampling divided the logits by the temperature, so the
        # log-probs of those samples must too (as in TRL's GRPO and OpenRLHF).
        logits = out.logits[:, -(k + 1) : -1]
        del out
        if temperature != 1.0:
            logits = logits / temperature
        parts.append(selective_log_softmax(logits, input_ids[rows, -k:]))
    return torch.cat(parts, dim=0)


@torch.no_grad()
def completion_logprob_sums(
    model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad: int, batch_size: int = 16
) -> list[float]:
    """log p(completion | prompt) under `model` at temperature 1, summed over each completion's tokens.

    Lists of B token-id lists -> B floats (an empty completion: 0). Rows are batched by length
    (`prompt_completion_batch`, `sequence_logprobs`), so padding changes nothing but float ordering.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: -(len(prompt_ids[i]) + len(completion_ids[i])))
    sums = [0.0] * len(prompt_ids)
    for start in range(0, len(order), batch_size):
        batch = [i for i in order[start : start + batch_size] if completion_ids[i]]
        if not batch:
            continue
        ids, attention, mask = prompt_completion_batch(
            [prompt_ids[i] for i in batch], [completion_ids[i] for i in batch], pad, device
        )
        logprobs = sequence_logprobs(model, ids, attention, mask.shape[1])
        for row, value in zip(batch, (logprobs * mask).sum(-1).tolist()):
            sums[row] = value
    return sums


# ---------------------------------------------------------------------------------------------------
# KL estimators and KL-penalised rewards
# ---------------------------------------------------------------------------------------------------


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi.

    Shapes: [B, T], [B, T] -> [B, T]. With d = logp - logp_ref, as estimates of the KL's value:
      k1 = d                      (unbiased, high variance, can be negative)
      k2 = 0.5 * d**2             (biased, low variance, >= 0)
      k3 = exp(-d) - 1 + d        (unbiased, low variance, >= 0)
    Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html.
    Swapping the arguments estimates the other direction for samples from the second argument.
    Unbiased in value is not unbiased in gradient: as a reward (detached, through the score function
    E[grad log pi * k]) only k1 gives grad KL(pi || ref); k3 gives grad KL(pi || ref) - grad KL(ref || pi)
    and k2 gives grad E[d**2 / 2] - grad KL(pi || ref), both zero to first order at the reference, so
    the ppo stage pays k1 only (tests/test_reward_paths.py checks this exactly).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(_KL_KINDS)}")


def last_token_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last position with mask != 0 in each row, and whether the row has one.

    Shapes: mask [B, T] -> (index [B] long, has_token [B] bool); index is 0 for all-zero rows.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    index = torch.where(mask != 0, positions, -1).amax(dim=-1)
    return index.clamp(min=0), index >= 0


def penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of RLHF: a KL penalty on every token plus the sequence score at the end.

    Shapes: scores [B], logprobs/ref_logprobs/mask [B, T] -> (rewards [B, T], kl [B, T]).
    r_t = -kl_coef * KL_t + 1[t = last real token] * score  (Ziegler et al. 2019, eq. 2 and
    Stiennon et al. 2020, eq. 1). kl and rewards are 0 at masked positions. A row whose mask is
    all zero gets no score (its rewards stay 0) rather than an error. Pass detached tensors.
    The penalty is paid as a reward here, so k2 and k3 bias its gradient (`kl_estimate`); the ppo stage's
    config accepts k1 only.
    """
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
    kl = torch.where(mask != 0, kl, torch.zeros_like(kl))
    rewards = -kl_coef * kl
    index, has_token = last_token_index(mask)
    bonus = torch.where(has_token, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    rewards = rewards.scatter_add(1, index[:, None], bonus[:, None])
    return rewards, kl


# ---------------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over entries where mask != 0 (mask may hold weights).

    Shapes: x, mask same shape -> scalar (dim=None) or x reduced over `dim`.
    Equation: sum(x * m) / sum(m). Masked entries never enter, even if they hold inf/NaN; a
    reduction over an all-zero mask returns 0 instead of NaN (no NaN gradients from empty batches).
    """
    mask = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    masked = torch.where(mask != 0, x * mask, torch.zeros_like(mask))
    if dim is None:
        return masked.sum() / mask.sum().clamp(min=1e-8)
    return masked.sum(dim) / mask.sum(dim).clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over entries where mask != 0 (scalar).

    Equation: mean_m((x - mean_m(x))^2), times n / (n - 1) when `unbiased` (Bessel), n = sum(mask).
    Raises ValueError when the mask is empty, or holds a single entry and `unbiased` is set.
    """
    count = mask.sum()
    if count == 0 or (unbiased and count == 1):
        need = "two" if unbiased else "one"
        raise ValueError(f"masked_var needs {need} or more unmasked entries, got {count.item():g}")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise x to unit variance (and zero mean if `shift_mean`) using unmasked entries only.

    Shapes: x, mask [B, T] -> [B, T]. Equation: (x - mu) / sqrt(var + 1e-8) (+ mu if not shift_mean),
    mu and var (unbiased) over mask != 0. Masked entries are set to 0 in the output, so whitened
    advantages at padding contribute nothing even where a caller forgets the mask.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, torch.zeros_like(whitened))


class RunningMoments:
    """Running mean and variance of a stream of scalars (Welford 1962; Knuth, TAOCP vol. 2, 4.2.2).

    Per value x, with n counted from 1: delta = x - mean; mean += delta / n; m2 += delta * (x - mean).
    `std` is the unbiased sqrt(m2 / (n - 1)), with the divisor at least 1 (0 before two values). Plain
    Python floats, updated one value at a time in the order given: the same stream gives the same bits.
    `state_dict()` / `load_state_dict()` round-trip through JSON (a loop checkpoint's state.json).
    """

    def __init__(self, count: float = 0.0, mean: float = 0.0, m2: float = 0.0):
        self.count, self.mean, self.m2 = count, mean, m2

    def update(self, values) -> None:
        """Fold in each of `values` (an iterable of floats), in order."""
        for value in values:
            self.count += 1
            delta = value - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (value - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / max(self.count - 1, 1))

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


# ---------------------------------------------------------------------------------------------------
# GAE and losses
# ---------------------------------------------------------------------------------------------------


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a right-padded batch of completions.

    Shapes: rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T]).
    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}
    (Schulman et al. 2016, arXiv:1506.02438, eq. 11-16); returns R_t = A_t + V_t (value targets).
    The episode ends at the last real token: V after it is 0 (no bootstrap), masked positions
    contribute nothing, and advantages/returns are 0 there. `mask` must be ones then zeros per row.
    """
    rewards = torch.where(mask != 0, rewards, torch.zeros_like(rewards))
    values = torch.where(mask != 0, values, torch.zeros_like(values))
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
        next_value = values[:, t]
    advantages = torch.where(mask != 0, advantages, torch.zeros_like(advantages))
    return advantages, advantages + values


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (to minimise), token-level mean over the mask.

    Shapes: [B, T] each -> (loss scalar, stats). r = exp(logp - logp_old);
    loss = masked_mean(max(-A * r, -A * clip(r, 1 - eps, 1 + eps)))  (Schulman et al. 2017,
    arXiv:1707.06347, eq. 7, negated). stats (detached): `clipfrac` = fraction of tokens where the
    clipped term is strictly larger, i.e. the gradient is cut; `approx_kl` = masked mean of the k3
    estimate of KL(old || new) (samples come from old), exp(d) - 1 - d with d = logp - logp_old.
    `weights` [B, T] (detached, e.g. `importance_weights`) multiply each token's term before the mean,
    which keeps counting every token; a token of weight 0 adds exactly 0 even if its term is not finite.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = weighted_terms(per_token, weights)
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs, "k3"), mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss (to minimise), token-level mean over the mask.

    Shapes: [B, T] each -> (loss scalar, stats). v_clip = old + clip(v - old, -eps, eps);
    loss = 0.5 * masked_mean(max((v - R)^2, (v_clip - R)^2)), the PPO2 value clipping of OpenAI
    baselines used by Ziegler et al.; `clip_range_value=None` disables clipping.
    stats (detached): `vf_clipfrac` = fraction of tokens where the clipped error is strictly larger.
    """
    unclipped = (values - returns).square()
    if clip_range_value is None:
        clipped = unclipped
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
        clipped = (v_clip - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped > unclipped).float(), mask)}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How much of the returns' variance the value head explains (detached scalar).

    Shapes: [B, T] each -> 0-dim tensor. ev = 1 - Var_m(R - V) / Var_m(R) (biased variances over
    the mask): 1 is perfect, 0 is no better than a constant, < 0 is worse. NaN when Var_m(R) = 0.
    """
    with torch.no_grad():
        var_returns = masked_var(returns, mask, unbiased=False)
        var_residual = masked_var(returns - values, mask, unbiased=False)
        if var_returns == 0:
            return torch.full_like(var_returns, float("nan"))
        return 1.0 - var_residual / var_returns


# ---------------------------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------------------------


class FixedKLController:
    """Constant KL coefficient; `update` is a no-op so the loop can treat both controllers alike."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient that tracks a target KL (Ziegler et al. 2019, arXiv:1909.08593, eq. 2).

    e = clip(KL_current / KL_target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    Above target the coefficient grows, below it shrinks, by at most 20% per `horizon` steps.
    A NaN `current_kl` (a diverged step) leaves the coefficient unchanged.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply the coefficient by 1 + e * n_steps / horizon (see the class docstring)."""
        current_kl = float(current_kl)
        if math.isnan(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def make_kl_controller(
    kl_coef: float, target: float | None = None, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Fixed controller when `target` is None, else adaptive starting at `kl_coef`."""
    if target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target, horizon)


# ---------------------------------------------------------------------------------------------------
# Importance-sampling correction for a sampler that is not the trainer
# ---------------------------------------------------------------------------------------------------

_IS_LEVELS = ("token", "sequence")
_IS_MODES = ("truncate", "mask")


def importance_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    low: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached weights that correct a loss for tokens drawn by a sampler other than the trainer's policy.

    Shapes: [B, T] each -> (weights [B, T], stats). `sampler_logprobs` are the log-probs the sampler drew
    with, after its temperature and top-p/top-k/min-p (the processed distribution), else the truncation
    itself biases the ratio (https://github.com/huggingface/trl/issues/6789); `trainer_logprobs` are the
    trainer's own forward on the same tokens. With lr = trainer - sampler on the tokens:
      level="token":    r_t = exp(lr_t)
      level="sequence": r_t = exp(sum_{s in mask} lr_s) for every token of the row (summed in log space)
      mode="truncate":  w = min(r, cap)   (TIS: Yao et al. 2025, "Your efficient RL framework secretly
                        brings you off-policy RL training"); `low` must be None
      mode="mask":      w = r if low <= r <= cap else 0   (MIS / IcePop); low=None means no lower bound
    w is 0 at masked positions and where lr is NaN or +-inf (a sampler's -inf or NaN log-prob:
    https://github.com/huggingface/trl/pull/6266): at sequence level one such token zeroes its whole row.
    stats (detached 0-dim, over tokens with mask != 0): `is_ratio_mean` and `is_ratio_max` of r over the
    finite tokens (inf when a sequence's log-ratio overflows exp; its weight is still finite),
    `is_clipped_frac` = share with r > cap (truncate) or r outside [low, cap] (mask), `is_nonfinite_frac`
    = share whose own lr is not finite, `sampler_kl` = k3 estimate of KL(sampler || trainer), the mean of
    exp(lr_t) - 1 - lr_t over the finite tokens at either level (the tokens are the sampler's samples;
    `kl_estimate(sampler, trainer, "k3")`).
    """
    if trainer_logprobs.shape != sampler_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    if level not in _IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {', '.join(_IS_LEVELS)}")
    if mode not in _IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {', '.join(_IS_MODES)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if low is not None and (mode != "mask" or not 0 <= low <= cap):
        raise ValueError(f"low applies to mode='mask' only and must be in [0, cap={cap}], got {low}")
    with torch.no_grad():
        valid = mask != 0
        token_lr = trainer_logprobs.detach() - sampler_logprobs.detach()
        nonfinite = valid & ~torch.isfinite(token_lr)
        kept = valid & ~nonfinite
        lr = torch.where(kept, token_lr, torch.zeros_like(token_lr))
        if level == "sequence":
            # One bad token leaves the row's product undefined, so the whole row is dropped (and counted).
            kept = valid & ~nonfinite.any(dim=-1, keepdim=True)
            lr = torch.where(kept, lr.sum(dim=-1, keepdim=True).expand_as(lr), torch.zeros_like(lr))
        # Compare and cap in log space: a long sequence's summed log-ratio overflows exp() long before
        # its capped weight does.
        log_cap = math.log(cap)
        if mode == "truncate":
            cut = kept & (lr > log_cap)
            weights = torch.where(kept, torch.exp(torch.clamp(lr, max=log_cap)), torch.zeros_like(lr))
        else:
            log_low = -math.inf if low is None or low == 0 else math.log(low)
            cut = kept & ((lr > log_cap) | (lr < log_low))
            weights = torch.where(kept & ~cut, torch.exp(lr), torch.zeros_like(lr))

        ratio = torch.exp(lr)
        count = valid.sum().clamp(min=1)
        stats = {
            "is_ratio_mean": masked_mean(ratio, kept),
            "is_ratio_max": (
                torch.where(kept, ratio, torch.zeros_like(ratio)).amax()
                if kept.any()
                else torch.zeros((), dtype=ratio.dtype, device=ratio.device)
            ),
            "is_clipped_frac": cut.sum() / count,
            "is_nonfinite_frac": nonfinite.sum() / count,
            "sampler_kl": masked_mean(
                kl_estimate(sampler_logprobs.detach(), trainer_logprobs.detach(), "k3"), valid & ~nonfinite
            ),
        }
    return weights, stats


def weighted_terms(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token loss terms times detached weights, 0 (not NaN) wherever the weight is 0.

    Shapes: [B, T], [B, T] -> [B, T]. How `importance_weights` enter a loss: PPO passes them as
    `policy_loss(..., weights=w)`; a GRPO-style loss (per-token -A * clipped ratio, optional beta * KL)
    takes `masked_mean(weighted_terms(terms, w), mask)` or its per-sequence mean. The weights are the
    sampler's correction only, so they stay out of the ratio that PPO clips against its old policy.
    """
    weights = weights.detach().to(per_token.dtype)
    return torch.where(weights != 0, per_token * weights, torch.zeros_like(per_token))
