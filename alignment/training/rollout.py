"""PPO's rollout as one typed container: the per-sequence and per-token tensors of one update (`Rollout`),
their shapes checked when it is built, every field sliced together for minibatches; and the batch's scalar
statistics (`RolloutStats`: reward-part means, sampling time), which describe the batch, not a row, so are
kept apart and not sliced.

Masks. `response_mask` is the loss mask of every PPO term: the per-token KL penalty, GAE, the policy
loss and the value loss all read it, so a position it zeroes adds nothing to any of them. The rl.py
convention holds: [B, T] tensors derived here are 0 where it is 0. New masks go next to it, as [B, T]
fields: a future `tool_mask` (response tokens a tool wrote, which the policy did not sample) must be
taken out of the loss mask, since their log-probs are not the policy's choices.

Pure torch, no training-loop state: `python -m pytest tests/test_rollout.py -q`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


def shaped(*dims: str, optional: bool = False):
    """A tensor field whose shape is `dims` (named sizes shared across the fields of one Rollout)."""
    return field(default=None, metadata={"dims": dims}) if optional else field(metadata={"dims": dims})


@dataclass(frozen=True, eq=False)
class Rollout:
    """One PPO batch. `rollout[rows]` (a slice, a list or a 1-D tensor of row numbers or a boolean row mask)
    is the same type with those rows of every field.

    Shapes (B = sequences, T = response width, P + T = prompt width + response width; the layout
    `rl.prompt_completion_batch` builds and `rl.sequence_logprobs` reads):

      query_responses  [B, P+T]  token ids: the prompt left-padded (as generated), then the response right-padded
      attention_mask   [B, P+T]  1 on real prompt and response tokens, 0 on padding
      response_mask    [B, T]    1 on the response tokens the policy sampled (up to and including EOS)
      logprobs         [B, T]    log-probs of the sampled tokens under the policy that sampled them
      ref_logprobs     [B, T]    the same under the reference
      values           [B, T]    the critic's values at sampling time
      entropy          [B, T]    the policy's entropy at each response position
      scores           [B]       sequence scores before normalisation (reward model + verifiers - EOS penalty)
      finished         [B]       True where the response ended with a stop token
      advantages       [B, T]    GAE advantages (whitened if asked); None until computed after the rollout
      returns          [B, T]    the value targets (advantages before whitening + values); None until then
      is_weights       [B, T]    importance weights of the trainer's policy over the sampler's (`rl.importance_weights`,
                                 ppo's `importance_sampling:`); None without that correction
    """

    # tokens
    query_responses: torch.Tensor = shaped("B", "P+T")
    # masks: `response_mask` is the loss mask of the KL penalty, GAE, the policy and the value loss
    attention_mask: torch.Tensor = shaped("B", "P+T")
    response_mask: torch.Tensor = shaped("B", "T")
    # per token, at sampling time
    logprobs: torch.Tensor = shaped("B", "T")
    ref_logprobs: torch.Tensor = shaped("B", "T")
    values: torch.Tensor = shaped("B", "T")
    entropy: torch.Tensor = shaped("B", "T")
    # per sequence
    scores: torch.Tensor = shaped("B")
    finished: torch.Tensor = shaped("B")
    # computed after the rollout (`dataclasses.replace(rollout, advantages=..., returns=...)`)
    advantages: torch.Tensor | None = shaped("B", "T", optional=True)
    returns: torch.Tensor | None = shaped("B", "T", optional=True)
    is_weights: torch.Tensor | None = shaped("B", "T", optional=True)

    def __post_init__(self):
        sizes: dict[str, tuple[int, str]] = {}  # named size -> (size, the first field that had it)
        device = self.query_responses.device if isinstance(self.query_responses, torch.Tensor) else None
        for f in dataclasses.fields(self):
            value, dims = getattr(self, f.name), f.metadata["dims"]
            layout = f"[{', '.join(dims)}]"
            if value is None and f.default is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"Rollout.{f.name}: expected a tensor {layout}, got {type(value).__name__}")
            if value.dim() != len(dims):
                raise ValueError(f"Rollout.{f.name}: expected a tensor {layout}, got shape {list(value.shape)}")
            for dim, size in zip(dims, value.shape):
                first = sizes.setdefault(dim, (size, f.name))
                if first[0] != size:
                    raise ValueError(
                        f"Rollout.{f.name}: shape {list(value.shape)} does not fit {layout}: "
                        f"{dim} is {first[0]} in {first[1]}, {size} here"
                    )
            if value.device != device:
                raise ValueError(f"Rollout.{f.name}: on {value.device}, query_responses on {device}")
        if (self.advantages is None) != (self.returns is None):
            raise ValueError("Rollout: advantages and returns are set together (both or neither)")
        if sizes["P+T"][0] < sizes["T"][0]:
            raise ValueError(
                f"Rollout: query_responses has {sizes['P+T'][0]} columns, fewer than the "
                f"{sizes['T'][0]} of response_mask"
            )

    def __len__(self) -> int:
        return self.query_responses.shape[0]

    def __getitem__(self, rows) -> Rollout:
        if isinstance(rows, int) or (isinstance(rows, torch.Tensor) and rows.dim() == 0):
            raise TypeError(
                "Rollout: index rows with a slice, a list or a 1-D tensor; one int would drop the batch dimension"
            )
        return self._map({"B": rows})

    @property
    def response_width(self) -> int:
        """T: the number of response columns."""
        return self.response_mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.query_responses.device

    def trimmed(self) -> Rollout:
        """The same rows without the columns that are padding in every row: the trailing response columns
        (at least one is kept) and the leading prompt columns (prompts are left-padded). A causal model's
        outputs at the columns kept do not change (position ids count from each row's first token,
        `actor_critic.position_ids`), and every masked sum over [B, T] is the same, so a micro-batch of
        short responses costs only its longest one, and one of short prompts only its longest prompt.
        Contiguous copies (as `x[rows, :k]` gives): the forward pass sees one memory layout, cut or not."""
        keep = max(int(self.response_mask.sum(1).max().item()), 1)
        prompt_width = self.query_responses.shape[1] - self.response_width
        real = self.attention_mask[:, :prompt_width].any(0).nonzero()
        start = int(real[0]) if len(real) else prompt_width
        return self._map({"P+T": slice(start, prompt_width + keep), "T": slice(None, keep)}, contiguous=True)

    def _map(self, index: dict, contiguous: bool = False) -> Rollout:
        """Every tensor field indexed along its named dimensions: `index` maps a dimension name (B, P+T, T)
        to what that dimension is indexed with; dimensions it leaves out are kept whole."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = value[tuple(index.get(dim, slice(None)) for dim in f.metadata["dims"])]
                changes[f.name] = value.contiguous() if contiguous else value
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RolloutStats:
    """What a rollout says about the whole batch rather than a row (so not sliced with it)."""

    reward_means: dict[str, float]  # batch mean of each score part: "rm_score", "verifier/<name>"
    sample_seconds: float  # wall time of sampling
