"""A DPO policy read as a reward model (Rafailov et al. 2023, section 5, "your language model is secretly a
reward model"):

    r(x, y) = beta * sum over the answer's tokens t of [log pi(y_t | x, y_<t) - log ref(y_t | x, y_<t)]

pi is a `dpo` stage's output, ref the model it started from, beta its `train.beta`. The dpo stage writes
`implicit_reward.json` (`write_marker`) beside its checkpoint, so `reward_model: ${dpo}` works wherever a
reward stage's output does (ppo, rsft, rlvr, evaluation) and scores the same rendered text
(`training.scoring.score_texts`), summing over the answer's tokens only. Why: a model can hold a preference
in its token likelihoods where no linear head on its last hidden state finds it; on SmolLM2's arithmetic
pairs this reward ranked held-out pairs far better than a Bradley-Terry classifier did (measured:
docs/results.md, "From preferences alone").

Cost: two forward passes (policy and reference) per scored batch, both whole models; with LoRA the
checkpoint's merged weights stand for the policy, exactly on CPU (fp32), to bf16 rounding on a GPU.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..errors import UserError
from ..rl import completion_logprob_sums

MARKER = "implicit_reward.json"


def write_marker(out_dir: Path, reference: str, beta: float, final_dir: Path | None = None) -> None:
    """Record in a dpo stage's output (`out_dir`, moved to `final_dir` when the stage ends) the reference it
    was trained against and its beta. A local reference is stored relative to the final folder, so a run
    folder moved as a whole still resolves."""
    local = Path(reference).expanduser()
    home = Path(final_dir if final_dir is not None else out_dir).resolve()
    stored = os.path.relpath(local.resolve(), home) if local.exists() else reference
    (Path(out_dir) / MARKER).write_text(json.dumps({"reference": stored, "beta": beta}, indent=2) + "\n")


def is_implicit_reward_model(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists()


def read_marker(path: str | Path) -> tuple[str, float]:
    """(reference model as a loadable path or hub id, beta) of a dpo stage's output."""
    file = Path(path) / MARKER
    try:
        spec = json.loads(file.read_text())
        reference, beta = spec["reference"], float(spec["beta"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(
            f"'{file}' does not name a reference model and a beta ({type(error).__name__}: {error}); "
            "it is written by the dpo stage: run that stage again."
        ) from None
    if not math.isfinite(beta) or beta <= 0:
        raise UserError(f"'{file}': beta must be a positive number, got {spec['beta']!r}.")
    local = Path(path) / reference
    if local.exists():
        return str(local.resolve()), beta
    if reference.startswith((".", "/", "~")) or reference.count("/") > 1:
        raise UserError(
            f"'{path}' is a DPO policy whose implicit reward needs the model it started from, "
            f"'{reference}' (from {MARKER}), which does not exist; keep the two folders together."
        )
    return reference, beta


class ImplicitRewardModel(torch.nn.Module):
    """beta * (log pi - log ref) summed over a completion's tokens; both models frozen, moved together."""

    def __init__(self, policy: torch.nn.Module, reference: torch.nn.Module, beta: float):
        super().__init__()
        self.policy, self.reference, self.beta = policy, reference, beta
        self.eval().requires_grad_(False)

    @property
    def config(self):
        return self.policy.config

    def score(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad: int, batch_size: int = 16
    ) -> list[float]:
        """The implicit reward of each (prompt ids, completion ids); an empty completion scores 0."""
        policy = completion_logprob_sums(self.policy, prompt_ids, completion_ids, pad, batch_size)
        reference = completion_logprob_sums(self.reference, prompt_ids, completion_ids, pad, batch_size)
        return [self.beta * (p - r) for p, r in zip(policy, reference)]
