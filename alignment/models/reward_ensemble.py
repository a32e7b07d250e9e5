"""Reward models trained k times on the same pairs from different seeds, read as one reward (Coste et al. 2023,
"Reward Model Ensembles Help Mitigate Overoptimization", arXiv:2310.02743). Members agree where the pairs taught
them and disagree where a policy pushed by one of them drifts off the pairs; the combinations reward that agreement:

    mean: (1/k) sum_i r_i                      the ensemble's mean score
    min:  min_i r_i                            worst-case optimisation (WCO): the most pessimistic member
    uwo:  mean - penalty * var_i(r_i)          uncertainty-weighted optimisation: the mean, less the members'
                                               (population) variance times `penalty`

A `reward` stage with `ensemble: {members: k}` writes member 0 as its ordinary checkpoint (so tools that know
nothing of ensembles load the folder as one reward model), members 1..k-1 under `members/`, and
`reward_ensemble.json` beside them (`write_marker`); `load_reward_model` then returns a `RewardEnsemble`, and
`reward_model: ${rm}` reads the combined score (`combine_scores`) wherever one member's would be read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError

MARKER = "reward_ensemble.json"
COMBINES = ("mean", "min", "uwo")


def member_dir(out_dir: str | Path, index: int) -> Path:
    """Where member `index` lives in a reward stage's output: member 0 is the folder itself."""
    return Path(out_dir) if index == 0 else Path(out_dir) / "members" / str(index)


def write_marker(out_dir: Path, members: int, combine: str, penalty: float) -> None:
    paths = [str(member_dir(".", i)) for i in range(members)]
    (Path(out_dir) / MARKER).write_text(json.dumps({"members": paths, "combine": combine, "penalty": penalty},
                                                   indent=2) + "\n")


def is_reward_ensemble(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists()


def read_marker(path: str | Path) -> tuple[list[str], str, float]:
    """(member folders as paths, combine, penalty) of a reward stage's ensemble output."""
    file = Path(path) / MARKER
    try:
        spec = json.loads(file.read_text())
        members = [str((Path(path) / m).resolve()) for m in spec["members"]]
        combine, penalty = spec["combine"], float(spec["penalty"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"'{file}' does not list ensemble members with a combine rule ({type(error).__name__}: "
                        f"{error}); it is written by the reward stage: run that stage again.") from None
    if combine not in COMBINES or not members:
        raise UserError(f"'{file}': combine must be one of {', '.join(COMBINES)} over at least one member, got "
                        f"{combine!r} over {len(members)}.")
    missing = [m for m in members if not (Path(m) / "config.json").exists()]
    if missing:
        raise UserError(f"'{path}' is a reward-model ensemble whose member(s) {', '.join(missing)} do not exist; keep "
                        f"the folder whole (members/ beside {MARKER}) or run the reward stage again.")
    return members, combine, penalty


def combine_scores(scores: torch.Tensor, combine: str, penalty: float = 0.0) -> torch.Tensor:
    """[members, n] scores -> [n] combined, as the module docstring defines.

    The members' scores are combined as they are: each was trained on the same pairs with the same centering,
    so their offsets agree to the extent the members do."""
    if combine == "mean":
        return scores.mean(dim=0)
    if combine == "min":
        return scores.min(dim=0).values
    if combine == "uwo":
        return scores.mean(dim=0) - penalty * scores.var(dim=0, unbiased=False)
    raise ValueError(f"unknown combine {combine!r}; one of {', '.join(COMBINES)}")


class RewardEnsemble(torch.nn.Module):
    """Frozen reward models moved together; `training.scoring` scores each member and combines."""

    def __init__(self, members: list[torch.nn.Module], combine: str, penalty: float):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.combine, self.penalty = combine, penalty
        self.eval().requires_grad_(False)

    @property
    def config(self):
        return self.members[0].config

    def combined(self, member_scores: list[list[float]]) -> list[float]:
        return combine_scores(torch.tensor(member_scores, dtype=torch.float64), self.combine, self.penalty).tolist()
