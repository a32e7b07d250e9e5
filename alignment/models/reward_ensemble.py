"""Reward models trained k times on the same pairs from different seeds, read as one reward (Coste et al. 2023,
"Reward Model Ensembles Help Mitigate Overoptimization", arXiv:2310.02743). With r_i member i's score:

    mean: (1/k) sum_i r_i                      the ensemble's mean score (raw: an offset moves every answer alike)
    min:  min_i a_i                            worst-case optimisation (WCO): the most pessimistic member
    uwo:  mean_i a_i - penalty * var_i(a_i)    uncertainty-weighted optimisation (population variance)

where a_i = mean(mu) + mean(sigma) * (r_i - mu_i) / sigma_i is member i standardised on the reward stage's pairs
(mu_i, sigma_i: its scores' mean and std there) and put back on the members' average location and scale. A
Bradley-Terry model's offset is arbitrary, so raw members that rank alike would make min follow the lowest
offset and pay uwo to lower one member's score. The reward stage writes member 0 as its ordinary checkpoint,
members 1..k-1 under `members/`, and `reward_ensemble.json` (`write_marker`: members, combine, penalty, each
member's mu and sigma); `load_reward_model` returns a `RewardEnsemble` wherever one member's score would be read.
A folder written before the statistics existed still loads with mean; min and uwo refuse it (`read_marker`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..errors import UserError

MARKER = "reward_ensemble.json"
COMBINES = ("mean", "min", "uwo")


def member_dir(out_dir: str | Path, index: int) -> Path:
    """Where member `index` lives in a reward stage's output: member 0 is the folder itself."""
    return Path(out_dir) if index == 0 else Path(out_dir) / "members" / str(index)


def write_marker(
    out_dir: Path, members: int, combine: str, penalty: float, standardisation: list[tuple[float, float]]
) -> None:
    """The ensemble's description beside its members; `standardisation` is each member's (mean, std) of scores
    on the reward stage's pairs (`member_statistics`)."""
    paths = [str(member_dir(".", i)) for i in range(members)]
    stats = [{"mean": mean, "std": std} for mean, std in standardisation]
    (Path(out_dir) / MARKER).write_text(
        json.dumps({"members": paths, "combine": combine, "penalty": penalty, "standardise": stats}, indent=2) + "\n"
    )


def member_statistics(scores: list[list[float]]) -> list[tuple[float, float]]:
    """Each member's (mean, population std) of its scores on the same texts (`scores`: [members][texts]). A member
    whose scores do not vary there cannot be standardised: an error, never a division by zero."""
    table = torch.tensor(scores, dtype=torch.float64)
    means, stds = table.mean(dim=1), table.std(dim=1, unbiased=False)
    flat = [i for i, s in enumerate(stds.tolist()) if not math.isfinite(s) or s <= 0]
    if flat:
        raise UserError(
            f"ensemble member(s) {flat} score all {table.shape[1]} texts of the stage's pairs alike, so "
            "they cannot be standardised before they are combined; train longer or check the pairs."
        )
    return list(zip(means.tolist(), stds.tolist()))


def is_reward_ensemble(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists()


def read_marker(path: str | Path) -> tuple[list[str], str, float]:
    """(member folders as paths, combine, penalty) of a reward stage's ensemble output; a min or uwo ensemble
    written without its members' statistics is refused (`read_standardisation`)."""
    file = Path(path) / MARKER
    try:
        spec = json.loads(file.read_text())
        members = [str((Path(path) / m).resolve()) for m in spec["members"]]
        combine, penalty = spec["combine"], float(spec["penalty"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(
            f"'{file}' does not list ensemble members with a combine rule ({type(error).__name__}: "
            f"{error}); it is written by the reward stage: run that stage again."
        ) from None
    if combine not in COMBINES or not members:
        raise UserError(
            f"'{file}': combine must be one of {', '.join(COMBINES)} over at least one member, got "
            f"{combine!r} over {len(members)}."
        )
    missing = [m for m in members if not (Path(m) / "config.json").exists()]
    if missing:
        raise UserError(
            f"'{path}' is a reward-model ensemble whose member(s) {', '.join(missing)} do not exist; keep "
            f"the folder whole (members/ beside {MARKER}) or run the reward stage again."
        )
    if combine != "mean" and read_standardisation(path, len(members)) is None:
        raise UserError(
            f"'{file}' combines its members with {combine} but was written without each member's score "
            "statistics (an older reward stage): combined raw, members that rank alike differ by "
            "arbitrary offsets, which min and uwo would follow. Run the reward stage again (align run "
            "RECIPE --only STAGE --force), or read it with combine: mean."
        )
    return members, combine, penalty


def read_standardisation(path: str | Path, members: int) -> list[tuple[float, float]] | None:
    """Each member's (mean, std) from `reward_ensemble.json`, None where the folder has none (written before
    they were recorded)."""
    file = Path(path) / MARKER
    try:
        stats = json.loads(file.read_text()).get("standardise")
        if stats is None:
            return None
        pairs = [(float(s["mean"]), float(s["std"])) for s in stats]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UserError(
            f"'{file}': its `standardise` entry is not a list of {{mean, std}} ({type(error).__name__}: "
            f"{error}); it is written by the reward stage: run that stage again."
        ) from None
    if len(pairs) != members or not all(math.isfinite(m) and math.isfinite(s) and s > 0 for m, s in pairs):
        raise UserError(
            f"'{file}': `standardise` must give a finite mean and a positive std for each of the "
            f"{members} members, got {pairs}."
        )
    return pairs


def combine_scores(
    scores: torch.Tensor, combine: str, penalty: float = 0.0, standardisation: list[tuple[float, float]] | None = None
) -> torch.Tensor:
    """[members, n] scores -> [n] combined, as the module docstring defines; min and uwo read the members
    standardised by `standardisation` (each member's (mean, std)), or raw where it is None."""
    if combine == "mean":
        return scores.mean(dim=0)
    if standardisation is not None:
        scores = standardised(scores, standardisation)
    if combine == "min":
        return scores.min(dim=0).values
    if combine == "uwo":
        return scores.mean(dim=0) - penalty * scores.var(dim=0, unbiased=False)
    raise ValueError(f"unknown combine {combine!r}; one of {', '.join(COMBINES)}")


def standardised(scores: torch.Tensor, standardisation: list[tuple[float, float]]) -> torch.Tensor:
    """[members, n] -> [members, n]: member i as mean(mu) + mean(sigma) * (r_i - mu_i) / sigma_i, so members that
    rank alike agree whatever their offsets, in the units of an average member."""
    stats = torch.tensor(standardisation, dtype=scores.dtype, device=scores.device)
    if stats.shape != (scores.shape[0], 2):
        raise ValueError(f"{scores.shape[0]} members' scores but {len(standardisation)} members' statistics")
    mean, std = stats[:, :1], stats[:, 1:]
    return mean.mean() + std.mean() * (scores - mean) / std


class RewardEnsemble(torch.nn.Module):
    """Frozen reward models moved together; `training.scoring` scores each member and combines."""

    def __init__(
        self,
        members: list[torch.nn.Module],
        combine: str,
        penalty: float,
        standardisation: list[tuple[float, float]] | None = None,
    ):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.combine, self.penalty, self.standardisation = combine, penalty, standardisation
        self.eval().requires_grad_(False)

    @property
    def config(self):
        return self.members[0].config

    def combined(self, member_scores: list[list[float]]) -> list[float]:
        return combine_scores(
            torch.tensor(member_scores, dtype=torch.float64), self.combine, self.penalty, self.standardisation
        ).tolist()
