"""Stage kinds: one module per kind with `check(ctx)` and `run(ctx) -> metrics`; each kind's recipe keys are
its `Config` in `alignment/config/stages/`. `stage_module(kind)` imports only the kind it is asked for, so a
run imports TRL's trainers for the stages it runs and no others."""

from __future__ import annotations

import importlib

from ..config.stages import config_class

STAGES: dict[str, str] = {kind: f"alignment.stages.{kind}" for kind in ("sft", "reward", "dpo", "ppo", "rsft", "rlvr")}


def stage_module(kind: str, where: str = "stages"):
    config_class(kind, where)  # an unknown kind is the same error as when the recipe is loaded
    return importlib.import_module(STAGES[kind])
