"""Reward-model scoring: the scalar reward of (prompt, completion) pairs, read by the score head at the
last token of `render_prompt(p) + render_completion(p, c)` (the convention of `formatting.py`, tokenized
by `formatting.encode_prompt_completion`, exactly as the reward stage trains on it), or, for a dpo stage's
output (`models.implicit_reward`), summed as beta * (log pi - log ref) over the completion's tokens of the
same text, split where the dpo stage's pairs split prompt and answer; a reward stage's ensemble
(`models.reward_ensemble`) scores with every member and combines. Used by ppo, rsft and evaluation; rlvr
through `rewards.RewardModelReward`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from ..config.base import stage_ref
from ..data.formatting import (
    encode,
    encode_prompt_completion,
    render_completion,
    render_prompt,
)
from ..errors import UserError
from ..models.implicit_reward import (
    ImplicitRewardModel,
    is_implicit_reward_model,
    read_marker,
)
from ..models.loading import check_model_source, is_reward_classifier
from ..models.prefix import forward_after_prefix, shared_prefix, takes_position_ids
from ..models.reward_ensemble import RewardEnsemble, is_reward_ensemble
from ..models.reward_ensemble import read_marker as read_ensemble
from ..models.tokenizer import pad_token_id


def score_rendered(reward_model, tokenizer, texts: list[str], batch_size: int = 16) -> list[float]:
    """Scalar reward of already rendered texts, each tokenized whole (a classifier's: an implicit reward needs
    to know where the answer starts, `score_texts`)."""
    if isinstance(reward_model, ImplicitRewardModel):
        raise ValueError("an implicit reward model scores (prompt, completion) pairs: use score_texts")
    return score_ids(reward_model, tokenizer, [encode(tokenizer, t) for t in texts], batch_size)


def score_ids(reward_model, tokenizer, encoded: list[list[int]], batch_size: int = 16) -> list[float]:
    """Scalar reward of token sequences (right-padded batches; the head reads the last real token). The tokens a
    batch's rows all start with run once (`models.prefix`: the same scores up to summation order)."""
    if isinstance(reward_model, RewardEnsemble):
        return reward_model.combined([score_ids(m, tokenizer, encoded, batch_size) for m in reward_model.members])
    pad = pad_token_id(tokenizer)
    if getattr(reward_model.config, "pad_token_id", None) is None:
        reward_model.config.pad_token_id = pad
    device = next(reward_model.parameters()).device
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    scores = [0.0] * len(encoded)
    was_training = reward_model.training
    reward_model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            # The tokens every row starts with (a chat template's system prompt) run once per batch.
            shared = shared_prefix([encoded[i] for i in batch]) if takes_position_ids(reward_model) else 0
            width = max(len(encoded[i]) for i in batch) - shared
            ids = torch.full((len(batch), width), reward_model.config.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(encoded[i]) - shared] = torch.tensor(encoded[i][shared:])
                mask[row, : len(encoded[i]) - shared] = 1
            prefix = torch.tensor(encoded[batch[0]][:shared], device=device)
            logits = forward_after_prefix(reward_model, prefix, ids.to(device), mask.to(device)).logits
            for row, i in enumerate(batch):
                scores[i] = float(logits[row, 0])
    reward_model.train(was_training)
    return scores


def score_texts(
    reward_model,
    tokenizer,
    prompts: list,
    completions: list[str],
    batch_size: int = 16,
    finished: list[bool] | None = None,
) -> list[float]:
    """Reward of each (prompt, completion): prompts are strings or chat messages, completions plain answer
    text (as `sampling.Sample.text`). A finished answer is rendered as `render_prompt(p) +
    render_completion(p, c)`, the text the reward stage trains on; one that was cut off (`finished[i]` false,
    as `Sample.finished`) as `render_prompt(p) + c`, without the end-of-turn token it never sampled, so the
    reward model judges what was sampled rather than a finished answer it was not. An implicit reward scores a
    cut-off answer at the lower of that reading and the same text finished (`implicit_scores`)."""
    finished = [True] * len(completions) if finished is None else finished
    if not len(prompts) == len(completions) == len(finished):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions and {len(finished)} finished flags")
    encoded = []
    for p, c, done in zip(prompts, completions, finished):
        prompt_ids, completion_ids = encode_prompt_completion(
            tokenizer, render_prompt(tokenizer, p), render_completion(tokenizer, p, c) if done else c
        )
        encoded.append((prompt_ids, completion_ids))
    if isinstance(reward_model, ImplicitRewardModel):
        return implicit_scores(reward_model, tokenizer, prompts, completions, finished, encoded, batch_size)
    return score_ids(reward_model, tokenizer, [p + c for p, c in encoded], batch_size)


def implicit_scores(
    reward_model: ImplicitRewardModel,
    tokenizer,
    prompts: list,
    completions: list[str],
    finished: list[bool],
    encoded: list[tuple[list[int], list[int]]],
    batch_size: int,
) -> list[float]:
    """The implicit reward of each encoded (prompt, completion); a cut-off one scores min(r(y), r(y + end of turn)).

    beta * log pi/ref summed over an unfinished answer skips the end-of-turn term, where the DPO policy says
    whether the answer should end, so a reading without it can pay for not finishing. The minimum never pays
    more than ending the same text would, nor more than the text as sampled; in PPO at kl_coef = beta (where
    the DPO policy is the optimum) a cut-off answer's return is min(0, beta * that term's log-ratio), never
    above a finished answer's 0, whatever its length (tests/test_reward_paths.py)."""
    pad = pad_token_id(tokenizer)
    scores = reward_model.score([p for p, _ in encoded], [c for _, c in encoded], pad, batch_size)
    cut = [i for i, done in enumerate(finished) if not done]
    if cut:
        ended = [
            encode_prompt_completion(
                tokenizer,
                render_prompt(tokenizer, prompts[i]),
                render_completion(tokenizer, prompts[i], completions[i]),
            )
            for i in cut
        ]
        as_finished = reward_model.score([p for p, _ in ended], [c for _, c in ended], pad, batch_size)
        for i, value in zip(cut, as_finished):
            scores[i] = min(scores[i], value)
    return scores


def implicit_reward_kl_note(reward_model, kl_coef: float, kl_target: float | None) -> str | None:
    """What a ppo stage should be told when its reward is a dpo output's implicit reward and its KL coefficient
    is below (or, adaptive, may fall below) that dpo stage's beta; None otherwise. The KL-regularised optimum
    is ref * (pi_dpo / ref) ** (beta / kl_coef): the DPO policy itself at kl_coef = beta, past it below."""
    if not isinstance(reward_model, ImplicitRewardModel):
        return None
    beta = reward_model.beta
    past = (
        f"kl_coef {kl_coef:g} is below the implicit reward's beta {beta:g}"
        if kl_coef < beta
        else f"kl_target adapts kl_coef (from {kl_coef:g}) and may take it below the implicit reward's beta {beta:g}"
        if kl_target is not None
        else None
    )
    if past is None:
        return None
    return (
        f"{past}: PPO's optimum is then ref * (pi_dpo / ref) ** (beta / kl_coef), past the DPO policy, and it "
        "gains by whatever the DPO policy raised over its reference, answer length included (the implicit "
        "reward is a sum over tokens). kl_coef: beta (fixed) makes the DPO policy itself the optimum."
    )


def check_reward_model(ref: str, path: str, where: str, trust_remote_code: bool = False) -> None:
    """`align check` of a stage's `reward_model:` (`ref` as written, `path` resolved): it resolves, and it is a
    one-label sequence classifier, a reward stage's ensemble whose members are, or a dpo stage's output whose
    reference resolves. An earlier stage's output that does not exist yet is checked when it does (the recipe's
    loading checked that stage's kind)."""
    if stage_ref(ref) and not (Path(path) / "config.json").exists():
        return  # produced by an earlier stage that has not run yet
    check_model_source(path, where, trust_remote_code)
    if is_reward_ensemble(path):
        for member in read_ensemble(path)[0]:
            check_classifier(member, member, f"{where} (a member of the ensemble '{ref}')", trust_remote_code)
        return
    if is_implicit_reward_model(path):
        check_model_source(read_marker(path)[0], f"{where} (the reference of '{ref}')", trust_remote_code)
        return
    check_classifier(ref, path, where, trust_remote_code)


def check_classifier(ref: str, path: str, where: str, trust_remote_code: bool = False) -> None:
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not is_reward_classifier(config):
        architectures = getattr(config, "architectures", None) or []
        raise UserError(
            f"{where}: '{ref}' is not a reward model (architecture {architectures or 'unknown'}, "
            f"{config.num_labels} label(s)); give the output of a `reward` or `dpo` stage or a "
            "*ForSequenceClassification checkpoint with one label."
        )
