"""The stage dispatch table (alignment/stages/__init__.py): every kind a recipe accepts has a module with `check`
and `run`, and dispatching one kind imports that kind's module only."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from alignment.config.stages import CONFIGS
from alignment.errors import UserError
from alignment.stages import STAGES, stage_module


def test_the_table_names_a_module_for_every_kind_a_recipe_accepts():
    assert list(STAGES) == list(CONFIGS)
    assert STAGES == {kind: f"alignment.stages.{kind}" for kind in CONFIGS}  # written out, the same paths


def test_an_unknown_kind_is_the_error_loading_a_recipe_gives():
    with pytest.raises(UserError, match="unknown stage kind 'sfx'.*did you mean"):
        stage_module("sfx")


DISPATCH_ONE = """
import json, sys
from alignment.stages import STAGES, stage_module
module = stage_module("sft")
print(json.dumps({"check": callable(module.check), "run": callable(module.run),
                  "loaded": sorted(m for m in STAGES.values() if m in sys.modules),
                  "grpo": "trl.trainer.grpo_trainer" in sys.modules}))
"""


def test_dispatching_a_kind_imports_its_module_and_no_other_stage():
    done = subprocess.run([sys.executable, "-c", DISPATCH_ONE], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        done.stdout.strip().splitlines()[-1]
        == '{"check": true, "run": true, "loaded": ["alignment.stages.sft"], "grpo": false}'
    )
