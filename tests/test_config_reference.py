"""The configuration reference (issue #27): every field of every config model has a description, docs/config.md
is exactly what `alignment/config/reference.py` renders from the models now, and `align keys KIND` prints the
keys of a stage kind with their descriptions."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest
from conftest import REPO
from pydantic import BaseModel

import alignment.config
from alignment.cli import main
from alignment.config import reference
from alignment.config.base import ByName, Strict
from alignment.config.sampling import ServerSampling
from alignment.config.stages.base import StageConfig
from alignment.config.tasks import SplitBands
from alignment.config.tools import ToolUse


def config_models() -> list[type[BaseModel]]:
    """Every pydantic model defined in a module of alignment/config/."""
    found = []
    for info in pkgutil.walk_packages(alignment.config.__path__, "alignment.config."):
        module = importlib.import_module(info.name)
        found += [
            value
            for value in vars(module).values()
            if inspect.isclass(value) and issubclass(value, BaseModel) and value.__module__ == module.__name__
        ]
    return found


def flat(text: str) -> str:
    return " ".join(text.split())


def test_every_field_of_every_config_model_has_a_description():
    models = config_models()
    assert len(models) > 20 and StageConfig in models
    missing = [
        f"{model.__module__}.{model.__qualname__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not missing, (
        "config fields without a description (give each `Field(..., description=...)`, then run "
        f"`{reference.COMMAND}`): " + ", ".join(missing)
    )


def test_every_config_model_is_in_the_reference():
    # StageConfig's keys appear in every stage kind's table, ToolUse's in those of the stages and suites it is
    # mixed into, SplitBands' in the generated tasks'; Strict, ByName and ServerSampling (a check shared by two
    # sampling blocks) have none of their own
    left_out = [
        f"{m.__module__}.{m.__qualname__}"
        for m in config_models()
        if m not in reference.documented_models()
        and m not in (StageConfig, ToolUse, SplitBands, Strict, ByName, ServerSampling)
    ]
    assert not left_out, f"config models no topic of alignment/config/reference.py reaches: {', '.join(left_out)}"


def test_docs_config_md_is_what_the_generator_renders_now():
    written = (REPO / "docs" / "config.md").read_text()
    assert written == reference.markdown(), (
        f"docs/config.md is stale: regenerate it with `{reference.COMMAND}` and commit the result"
    )


def test_reference_tables_carry_type_default_and_description():
    text = reference.markdown()
    assert "| `kl_target` | float \\| null, > 0 | `null` | adaptive KL controller target" in text
    assert "| `select` | best_of_n \\| top_k \\| threshold | `best_of_n` |" in text
    assert "[VerifierSpec](#verifierspec)" in text and '<a id="verifierspec"></a>' in text
    assert text.count("### `stages.<id>.data`: DataSpec") == 1  # a spec shared by every kind is written once


def test_align_keys_ppo_prints_each_key_with_its_description(capsys):
    main(["keys", "ppo"])
    out = flat(capsys.readouterr().out)
    for model, name in [(reference.topic("ppo").root, "kl_target"), (reference.topic("ppo").root, "kl_estimator")]:
        assert f"{name}:" in out and flat(model.model_fields[name].description) in out
    assert "cliprange:" in out and "stages.<id>.rollout" in out  # nested specs come whole with their stage kind


def test_align_keys_without_a_kind_prints_every_topic(capsys):
    main(["keys"])
    out = capsys.readouterr().out
    for topic in reference.topics().values():
        assert topic.title.replace("`", "") in out


def test_align_keys_names_the_kinds_for_an_unknown_one(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["keys", "ppx"])
    assert exited.value.code == 2
    assert "did you mean 'ppo'?" in capsys.readouterr().err


def test_the_reference_imports_no_torch():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, alignment.config.reference\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'trl'}))",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
