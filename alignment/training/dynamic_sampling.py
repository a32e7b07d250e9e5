"""Dynamic sampling for GRPO/RLOO (DAPO, Yu et al. 2025, arXiv:2503.14476): groups whose rewards do not differ are
dropped and the batch refilled from fresh prompts, up to `max_draws` generations per batch.

`DynamicSampling(trainer, signal, max_draws, seed)` replaces the trainer instance's `_generate_and_score_completions`
with itself (the class is untouched): in training it calls TRL's method once per draw, reads which groups were
flat from `rewards.GroupSignal` (which sees every reward), keeps groups with spread first (`signal.keep_groups`)
and joins the kept rows of the draws into one batch of the usual size, each tensor re-padded as TRL pads it. A
batch still short after `max_draws` draws is filled with flat groups (counted), never shrunk. Evaluation is left
alone. Each refill draws a whole generation batch of prompts in a seeded order of its own, so a prompt may recur
within an epoch. Limits: text-only batches (image keys are refused); each process must hold whole groups; under
`scale_rewards: batch` each draw's advantages are scaled by the spread of their own draw.
"""

from __future__ import annotations

import random
from collections import Counter

import torch
from accelerate.utils import gather

from ..errors import UserError
from ..runtime.dist import get_logger
from .signal import keep_groups

log = get_logger(__name__)

# How each tensor of TRL's batch is padded: (side, value); None: the tensor's own pad value is the pad token id.
PADDING = {
    "prompt_ids": ("left", None),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", None),
    "completion_mask": ("right", 0),
    "old_per_token_logps": ("right", 0.0),
    "ref_per_token_logps": ("right", 0.0),
    "sampling_per_token_logps": ("right", 0.0),
    "importance_sampling_ratio": ("right", 0.0),
    "tool_mask": ("right", 1),
}
ROWS = ("advantages", "old_logps")  # one value per row (RLOO's old_logps: a sequence's summed log-prob)


class DynamicSampling:
    """The trainer's generate-and-score step with flat groups dropped and refilled (see the module docstring)."""

    def __init__(self, trainer, signal, max_draws: int, seed: int, where: str):
        self.trainer, self.signal, self.max_draws, self.where = trainer, signal, max_draws, where
        self.generate = trainer._generate_and_score_completions
        self.size = trainer.num_generations
        accelerator = trainer.accelerator
        self.process, self.processes = accelerator.process_index, accelerator.num_processes
        local = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
        if self.processes > 1 and local % self.size:
            raise UserError(
                f"{where}.dynamic_sampling: each process must hold whole groups, but its generation batch "
                f"of {local} completions (per_device_train_batch_size x steps_per_generation) is not a "
                f"multiple of num_generations={self.size}; change one of them."
            )
        self.order = random.Random(f"{seed}-refill-{self.process}")
        self.pool: list[int] = []
        self.counts: Counter = Counter()
        trainer._generate_and_score_completions = self

    def __call__(self, inputs: list[dict]) -> dict:
        if not self.trainer.model.training or self.max_draws < 2:
            return self.generate(inputs)
        groups = len(inputs) // self.size  # this process's groups per draw
        outputs, flags = [], []  # flags: per draw, every process's groups (GroupSignal gathers them)
        batch = inputs
        for draw in range(self.max_draws):
            self.signal.last_flat = None
            outputs.append(self.generate(batch))
            if self.signal.last_flat is None or len(self.signal.last_flat) != groups * self.processes:
                raise RuntimeError(
                    f"dynamic sampling expected {groups * self.processes} groups' rewards from the "
                    "reward functions and saw none or another count"
                )
            flags.append(self.signal.last_flat)
            if draw + 1 == self.max_draws or all(self.enough(flags, p, groups) for p in range(self.processes)):
                break
            batch = self.fresh(len(inputs))
        every = [
            keep_groups([f[p * groups : (p + 1) * groups] for f in flags], groups) for p in range(self.processes)
        ]  # the same on every process: counted once for all
        self.counts.update(
            batches=1, draws=len(flags), groups=groups * self.processes, short=any(c["filled"] for _, c in every)
        )
        for _, counts in every:
            self.counts.update(counts)
        chosen = every[self.process][0]
        return self.join(outputs, [(d, g * self.size + i) for d, g in chosen for i in range(self.size)])

    def enough(self, flags: list[list[bool]], process: int, groups: int) -> bool:
        """Whether `process` has `groups` groups with spread among the draws so far."""
        return sum(not flat for f in flags for flat in f[process * groups : (process + 1) * groups]) >= groups

    def fresh(self, rows: int) -> list[dict]:
        """`rows // size` prompts not drawn since the pool was last refilled, each repeated `size` times as TRL's
        sampler repeats them."""
        dataset = self.trainer.train_dataset
        picked = []
        for _ in range(rows // self.size):
            if not self.pool:
                self.pool = self.order.sample(range(len(dataset)), len(dataset))
            picked.append(dict(dataset[self.pool.pop()]))
        return [dict(row) for row in picked for _ in range(self.size)]

    def join(self, outputs: list[dict], rows: list[tuple[int, int]]) -> dict:
        """One batch of `rows` ((draw, row) pairs) out of the draws' outputs, each tensor padded as TRL pads it."""
        unknown = set(outputs[0]) - set(PADDING) - set(ROWS) - {"num_items_in_batch"}
        if unknown:
            raise UserError(
                f"{self.where}.dynamic_sampling: the batch holds {', '.join(sorted(unknown))}, which it "
                "cannot join (text-only batches); turn dynamic_sampling off."
            )
        pad_id = self.trainer.processing_class.pad_token_id
        joined = {}
        for key in outputs[0]:
            if key == "num_items_in_batch":
                continue
            parts = [outputs[d][key][r] for d, r in rows]
            if key in ROWS:
                joined[key] = torch.stack(parts)
                continue
            side, value = PADDING[key]
            joined[key] = pad_rows(parts, side, pad_id if value is None else value)
        if "num_items_in_batch" in outputs[0]:  # tokens in the loss over all processes, as TRL counts them
            mask = joined["completion_mask"] * joined.get("tool_mask", 1)
            joined["num_items_in_batch"] = gather(mask.sum().reshape(1)).sum()
        return joined

    def metrics(self) -> dict[str, float]:
        """For stage.json: draws per batch, groups dropped, flat groups trained because the bound ran out."""
        c = self.counts
        if not c["batches"]:
            return {}
        return {
            "dynamic_sampling/batches": c["batches"],
            "dynamic_sampling/draws": c["draws"],
            "dynamic_sampling/groups_dropped": c["dropped"],
            "dynamic_sampling/groups_filled": c["filled"],
            "dynamic_sampling/groups_spare": c["spare"],
            "dynamic_sampling/batches_short": c["short"],
            "zero_variance_groups_trained": c["filled"] / c["groups"],
        }

    def report(self) -> None:
        """Say how often the bound ran out: then flat groups were trained on, and more draws or easier/harder
        prompts would help."""
        found = self.metrics()
        if found.get("dynamic_sampling/batches_short"):
            log.warning(
                f"[{self.where}] dynamic sampling: {found['dynamic_sampling/batches_short']} of "
                f"{found['dynamic_sampling/batches']} batches were still short of groups with spread after "
                f"{self.max_draws} draws and were filled with {found['dynamic_sampling/groups_filled']} flat "
                "groups (zero_variance_groups_trained in stage.json); raise dynamic_sampling.max_draws or "
                "set prompt_filter."
            )


def pad_rows(rows: list[torch.Tensor], side: str, value) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into [B, max length], padded on `side` with `value`."""
    width = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), width), value)
    for i, r in enumerate(rows):
        if side == "left":
            out[i, width - r.shape[0] :] = r
        else:
            out[i, : r.shape[0]] = r
    return out
