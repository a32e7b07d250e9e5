"""Where an RL stage's learning signal is: pure rules on rewards and pass rates, no model, no torch.

`flat_groups` marks the groups (`size` consecutive rewards of one prompt) whose rewards do not differ, which give
GRPO/RLOO no advantage. `keep_groups` is dynamic sampling's choice of groups for one batch out of several draws
(Yu et al. 2025, DAPO, arXiv:2503.14476, section 3.2): groups with spread first, in draw order; a batch the bound
left short is filled with flat groups, never left smaller. `pass_rate_bounds` is the prompt filter's rule: keep a
prompt whose pass rate under the start policy lies in [low, high], counting the rest as too hard or too easy.
"""

from __future__ import annotations

from collections.abc import Sequence

SPREAD_EPS = 1e-9  # rewards closer than this count as equal (the same tolerance GroupSignal counts with)


def flat_groups(rewards: Sequence[float], size: int) -> list[bool]:
    """One flag per group of `size` consecutive rewards: True when its rewards do not differ."""
    if size < 1 or len(rewards) % size:
        raise ValueError(f"{len(rewards)} rewards do not make whole groups of {size}")
    groups = [rewards[i : i + size] for i in range(0, len(rewards), size)]
    return [max(g) - min(g) <= SPREAD_EPS for g in groups]


def keep_groups(draws: Sequence[Sequence[bool]], needed: int) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """The (draw, group) pairs to train on, `needed` of them, out of `draws` (each draw's flat flags, in order).

    Groups with spread come first, in draw order; if there are fewer than `needed`, flat groups fill the rest
    (first draws first), so the batch keeps its size. Counts: `dropped` flat groups left out, `filled` flat groups
    kept because the draws ran out, `informative` groups with spread kept, `spare` ones left over."""
    informative = [(d, g) for d, flags in enumerate(draws) for g, flat in enumerate(flags) if not flat]
    flat = [(d, g) for d, flags in enumerate(draws) for g, is_flat in enumerate(flags) if is_flat]
    kept = informative[:needed]
    filled = flat[: needed - len(kept)]
    chosen = sorted(kept + filled)
    return chosen, {
        "dropped": len(flat) - len(filled),
        "filled": len(filled),
        "informative": len(kept),
        "spare": len(informative) - len(kept),
    }


def pass_rate_bounds(rates: Sequence[float], low: float, high: float) -> tuple[list[int], dict[str, int]]:
    """Indices of the rates within [low, high], and counts: `kept`, `too_hard` (below low), `too_easy` (above)."""
    kept = [i for i, r in enumerate(rates) if low <= r <= high]
    return kept, {"kept": len(kept), "too_hard": sum(r < low for r in rates), "too_easy": sum(r > high for r in rates)}
