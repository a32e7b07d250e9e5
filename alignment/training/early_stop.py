"""Early stopping on a gold measure (ppo's `early_stop:`): where over-optimisation of a reward model shows as
the gold measure falling while the proxy still rises (Gao et al. 2022, arXiv:2210.10760), the policy worth
keeping is the one where gold peaked. One update's gold is a mean over its rollouts, noisy (its standard
error shrinks only as 1/sqrt(rollouts)), so the watch compares the average of the last `window` updates; the
policy kept is the one that sampled the newest rollout in the best window (the check runs between an update's
rollout and its training)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class GoldWatch:
    """The running best of a gold measure's `window`-update average, and how long since it was set."""

    key: str  # the logged name, gold/<verifier>
    window: int
    patience: int | None  # None: never stop, only keep the best
    values: list[float] = field(default_factory=list)
    best: float = -math.inf
    best_update: int = 0  # the update whose rollout closed the best window (1-based); 0: none yet

    def observe(self, update: int, value: float) -> bool:
        """Record update `update`'s gold mean; True when its window average is a new best. No average is
        compared before `window` updates have been seen."""
        self.values.append(value)
        average = self.average()
        if average is None or average <= self.best:
            return False
        self.best, self.best_update = average, update
        return True

    def average(self) -> float | None:
        if len(self.values) < self.window:
            return None
        return sum(self.values[-self.window :]) / self.window

    def exhausted(self, update: int) -> bool:
        """True once `patience` updates have passed since the best (or, before any best, since the first full
        window could have set one)."""
        if self.patience is None:
            return False
        since = self.best_update if self.best_update else self.window
        return update - since >= self.patience

    def state(self) -> dict:
        return {"values": self.values, "best": self.best if self.best_update else None, "best_update": self.best_update}

    def restore(self, state: dict) -> None:
        self.values = list(state["values"])
        self.best = state["best"] if state["best"] is not None else -math.inf
        self.best_update = state["best_update"]
