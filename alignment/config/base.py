"""Validation plumbing shared by every spec of the config layer, and stage references.

Every user-facing spec derives from `Strict` (pydantic, unknown keys forbidden). `explain()` turns a
pydantic `ValidationError` into one readable paragraph that names the dotted key and, for unknown
keys, suggests the closest allowed one ("did you mean ..."). `stage_ref` reads a whole-value `${stage}`
reference, which names another stage's output.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class Strict(BaseModel):
    """Base for recipe specs: unknown keys are errors, values are type-checked."""

    model_config = ConfigDict(extra="forbid", validate_default=True, arbitrary_types_allowed=True)


class ByName(Strict):
    """A spec a recipe may give as a bare name: `calculator` stands for `{name: calculator}` (verifiers, tools)."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value):
        return {"name": value} if isinstance(value, str) else value


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def dotted(parts: Iterable[Any]) -> str:
    return ".".join(str(p) for p in parts if p != "")


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) pydantic model that owns the location `loc`."""
    current: Any = model
    for part in loc[:-1]:
        if part == "":  # a discriminated union's empty tag (config/tools.py's `environment:`)
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = next(_models_in(fields[part].annotation), None)
        if current is None:
            return []
    return sorted(getattr(current, "model_fields", {}))


def _models_in(annotation: Any):
    """The pydantic models a type names, through unions and `Annotated` (whose first argument is the type)."""
    if hasattr(annotation, "model_fields"):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def explain(error: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem: '<prefix.key>: what is wrong (got X)'."""
    lines = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        where = dotted([prefix, *loc]) or "(top level)"
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc)
            hint = did_you_mean(loc[-1], allowed)
            known = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
            lines.append(f"unknown key '{where}'{hint}{known}")
        elif item["type"] == "missing":
            lines.append(f"missing required key '{where}'")
        elif item["type"] == "value_error":  # our own validators already phrase the whole problem
            lines.append(f"'{where}': {item['msg'].removeprefix('Value error, ')}")
        else:
            got = item.get("input")
            shown = f" (got {got!r})" if not isinstance(got, dict) else ""
            lines.append(f"'{where}': {item['msg']}{shown}")
    return "; ".join(lines)


STAGE_REF_PREFIX = "${"


def stage_ref(value: Any) -> str | None:
    """The stage id in a whole-value reference '${sft}', else None."""
    if isinstance(value, str) and value.startswith(STAGE_REF_PREFIX) and value.endswith("}"):
        return value[2:-1]
    return None
