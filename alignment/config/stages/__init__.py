"""Each stage kind's config: the keys its recipe entry accepts, torch-free so that loading a recipe imports
no torch or TRL. `CONFIGS` maps a recipe `kind` to its `Config`; the runtime of each kind is
`alignment/stages/<kind>.py` (`check`, `run`), found by the same name in `alignment.stages.STAGES`.

    base     StageConfig: the keys every stage accepts
    sft reward dpo ppo rsft rlvr   one module per kind
"""

from __future__ import annotations

from ...errors import UserError
from ..base import did_you_mean
from . import dpo, ppo, reward, rlvr, rsft, sft
from .base import StageConfig

CONFIGS: dict[str, type[StageConfig]] = {
    "sft": sft.Config,
    "reward": reward.Config,
    "dpo": dpo.Config,
    "ppo": ppo.Config,
    "rsft": rsft.Config,
    "rlvr": rlvr.Config,
}


def config_class(kind: str, where: str = "stages") -> type[StageConfig]:
    """The `Config` of a stage kind; an unknown kind is a UserError with a "did you mean"."""
    if kind not in CONFIGS:
        raise UserError(
            f"{where}: unknown stage kind '{kind}'{did_you_mean(kind, CONFIGS)}; available kinds: {', '.join(CONFIGS)}."
        )
    return CONFIGS[kind]
