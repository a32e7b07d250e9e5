"""Stage kinds: one module per kind with `check(ctx)` and `run(ctx) -> metrics`; each kind's recipe keys are
its `Config` in `alignment/config/stages/`. `STAGES` is the dispatch table, kind -> module, written out in
full; `stage_module(kind)` imports the one module asked for, so a run imports the TRL trainers of the stages
it runs and no others."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..config.stages import config_class

# Module paths, not modules: importing every stage up front would import every TRL trainer, and rlvr's
# (GRPOTrainer, RLOOTrainer) imports vLLM where it is installed, a cost and a failure point for an sft run.
STAGES: dict[str, str] = {
    "sft": "alignment.stages.sft",
    "reward": "alignment.stages.reward",
    "dpo": "alignment.stages.dpo",
    "ppo": "alignment.stages.ppo",
    "rsft": "alignment.stages.rsft",
    "rlvr": "alignment.stages.rlvr",
}


def stage_module(kind: str, where: str = "stages") -> ModuleType:
    """The module of stage kind `kind` (its `check` and `run`); an unknown kind is the same error as when the
    recipe is loaded."""
    config_class(kind, where)
    return importlib.import_module(STAGES[kind])
