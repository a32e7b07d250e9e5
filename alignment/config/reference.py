"""The configuration reference, rendered from the pydantic models themselves: every key a recipe accepts, with
its type, default and description (the `description=` of its field, the one place a key is documented).

    python scripts/config_reference.py     # writes docs/config.md (tests/test_config_reference.py keeps it current)
    align keys ppo                          # the keys of one stage kind in the terminal; `align keys` for all

A topic is a root model and where its keys sit in a recipe: the top level (`Recipe`), each stage kind's
`Config` (`stages.CONFIGS`), the `evaluate:` block and each built-in task's parameters. `walk` follows every
field whose type names another model (`rollout:`, `train:`, `verifiers:` entries, suites, ...), each model once.
`markdown()` renders every topic, a model shared by several (`DataSpec`) once, the others linking to it;
`text(name)` renders one topic, whole, for the terminal. Torch-free: it imports the config layer only.
"""

from __future__ import annotations

import shutil
import textwrap
import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ..errors import UserError
from .base import did_you_mean, dotted
from .evaluate import EvaluateSpec
from .recipe import Recipe
from .stages import CONFIGS
from .tasks import TASK_PARAMS

COMMAND = "python scripts/config_reference.py"
STAGE_KEY = "stages.<id>"


@dataclass(frozen=True)
class Topic:
    name: str  # as in `align keys NAME`
    title: str
    root: type[BaseModel]
    key: str  # where the root's keys sit in a recipe ("" = the top level)
    note: str = ""  # what the topic is, where neither a `kind` description nor the key says it

    @property
    def summary(self) -> str:
        """What the topic is: its note, a stage kind's `kind` description, else where its keys go."""
        if self.note:
            return self.note
        kind = self.root.model_fields.get("kind")
        if kind is not None and kind.description:
            return (
                f"{kind.description}. Keys of a stage `{STAGE_KEY}` with `kind: {self.name}` (or with the id "
                f"`{self.name}`)."
            )
        return f"Keys under `{self.key}`." if self.key else "Keys at the top level of a recipe."


def topics() -> dict[str, Topic]:
    """Every topic, in the order of the reference."""
    found = [Topic("recipe", "Recipe (top level)", Recipe, "")]
    found += [Topic(kind, f"Stage kind `{kind}`", config, STAGE_KEY) for kind, config in CONFIGS.items()]
    found.append(Topic("evaluate", "Evaluation (`evaluate:`)", EvaluateSpec, "evaluate"))
    found += [
        Topic(
            task,
            f"Built-in task `{task}` (`data: {{task: {task}, ...}}`)",
            params,
            "data",
            f"Keys of a `data:` mapping with `task: {task}`, beside those of every data spec (DataSpec: "
            "split, shuffle, limit, ...).",
        )
        for task, params in TASK_PARAMS.items()
    ]
    return {topic.name: topic for topic in found}


def topic(name: str) -> Topic:
    """One topic; an unknown name is a UserError with a "did you mean" and the names there are."""
    known = topics()
    if name not in known:
        raise UserError(
            f"no config keys for '{name}'{did_you_mean(name, known)}; give one of {', '.join(known)} "
            "(or nothing, for all of them)."
        )
    return known[name]


def nested_models(annotation: typing.Any, suffix: str = "") -> typing.Iterator[tuple[type[BaseModel], str]]:
    """(model, key suffix) for every model a field's type names: `list[VerifierSpec]` -> (VerifierSpec, '[]')."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, suffix
        return
    inner = suffix + "[]" if typing.get_origin(annotation) in (list, tuple) else suffix
    for arg in typing.get_args(annotation):
        yield from nested_models(arg, inner)


def walk(root: type[BaseModel], key: str) -> dict[type[BaseModel], list[str]]:
    """{model: the keys it sits at}, in the order met, for `root` at `key` and every model nested in its fields
    (a model's own fields are followed once, where it is first met)."""
    places: dict[type[BaseModel], list[str]] = {}

    def visit(model: type[BaseModel], at: str) -> None:
        first = model not in places
        keys = places.setdefault(model, [])
        if at not in keys:
            keys.append(at)
        if first:
            for name, field in model.model_fields.items():
                for nested, suffix in nested_models(field.annotation):
                    visit(nested, dotted([at, field.alias or name]) + suffix)

    visit(root, key)
    return places


def documented_models() -> set[type[BaseModel]]:
    """Every model the reference renders."""
    return {model for t in topics().values() for model in walk(t.root, t.key)}


# ---------------------------------------------------------------------------------------------------
# One field: type, default, description


def type_name(annotation: typing.Any, link: typing.Callable[[type[BaseModel]], str] = lambda m: m.__name__) -> str:
    """A field's type as a recipe writer reads it: `int | null`, `k1 | k2 | k3`, `list[VerifierSpec]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if origin is typing.Annotated:  # a type with validation metadata (a discriminated union's tags): the type
        return type_name(args[0], link)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return link(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a, link) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a, link) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


BOUNDS = (("gt", "> {}"), ("ge", ">= {}"), ("lt", "< {}"), ("le", "<= {}"), ("min_length", "at least {} item(s)"))


def bounds(field: FieldInfo) -> str:
    """The field's numeric and length constraints: '> 0, <= 1'."""
    found = [
        text.format(getattr(m, name))
        for m in field.metadata
        for name, text in BOUNDS
        if getattr(m, name, None) is not None
    ]
    return ", ".join(found)


def yaml_value(value: typing.Any) -> str:
    """A default as it would be written in YAML (flow style)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def type_of(field: FieldInfo, link: typing.Callable[[type[BaseModel]], str] = lambda m: m.__name__) -> str:
    """The field's type with its bounds: 'float | null, > 0'."""
    limits = bounds(field)
    return type_name(field.annotation, link) + (f", {limits}" if limits else "")


def default_of(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True) if field.default is PydanticUndefined else field.default
    return yaml_value(value)


# ---------------------------------------------------------------------------------------------------
# Markdown: docs/config.md


HEADER = f"""# Configuration reference

<!-- Generated from the pydantic models in alignment/config/ by `{COMMAND}`: edit the field
descriptions there, then rerun it; tests/test_config_reference.py fails while this file is stale. -->

Every key a recipe accepts: its type, its default and what it does. An unknown key is an error with a "did you
mean" hint, except under the `train:` of a TRL-backed stage (sft, reward, dpo, rsft, rlvr), whose knobs go
verbatim to that stage's TRL config class (see TRL's documentation; one value is the toolkit's own:
`train_sampling_strategy: bucket_by_length` on sft, reward, dpo and rsft, batches of rows of about one length,
docs/performance.md), and the parameters of a built-in task in `data:`. `null` is YAML's None; \
`<id>` stands for a stage's id. In the terminal, `align keys KIND` prints the
keys of one stage kind (`align keys recipe`, `align keys evaluate`; `align keys` all of them)."""


def _escape(text: str) -> str:
    """Text for a Markdown table cell: `|` escaped, and `<` outside code spans, where it would open an HTML tag."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _code(text: str) -> str:
    return f"`{text}`" if text else "(top level)"


def markdown() -> str:
    """docs/config.md: every topic, each model once (where first met); later uses link to it."""
    every = list(topics().values())
    places: dict[type[BaseModel], list[str]] = {}
    for t in every:
        for model, keys in walk(t.root, t.key).items():
            places.setdefault(model, []).extend(k for k in keys if k not in places[model])
    anchors = {model: model.__name__.lower() for model in places} | {t.root: t.name for t in every}

    def link(model: type[BaseModel]) -> str:
        return f"[{model.__name__}](#{anchors[model]})"

    lines = [HEADER, "", "Contents: " + ", ".join(f"[{t.title}](#{t.name})" for t in every) + "."]
    done: set[type[BaseModel]] = set()
    for t in every:
        lines += ["", f'<a id="{t.name}"></a>', "", f"## {t.title}", "", _escape(t.summary)]
        for model in walk(t.root, t.key):
            if model in done:
                continue
            done.add(model)
            if model is not t.root:
                first, *others = places[model]
                lines += ["", f'<a id="{anchors[model]}"></a>', "", f"### {_code(first)}: {model.__name__}"]
                lines += ["", f"Also at {', '.join(_code(k) for k in others)}."] if others else []
            lines += ["", "| key | type | default | description |", "|---|---|---|---|"]
            for name, field in model.model_fields.items():
                lines.append(
                    f"| `{field.alias or name}` | {_escape(type_of(field, link))} | `{default_of(field)}` | "
                    f"{_escape(field.description or '')} |"
                )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Plain text: `align keys`


def text(name: str | None = None, width: int | None = None) -> str:
    """The keys of one topic (every model it reaches, whole) or, with no name, of all topics (each model once),
    as plain text wrapped to `width` (default: the terminal's)."""
    width = width or shutil.get_terminal_size().columns
    chosen = [topic(name)] if name else list(topics().values())
    lines: list[str] = []
    done: set[type[BaseModel]] = set()
    for t in chosen:
        title = t.title.replace("`", "")
        lines += ["", title, "=" * len(title), *textwrap.wrap(t.summary, width)]
        for model, keys in walk(t.root, t.key).items():
            if model in done:
                continue
            done.add(model)
            label = "" if model is t.root else f"  ({model.__name__})"
            lines += ["", ", ".join(k or "(top level)" for k in keys) + label]
            for field_name, field in model.model_fields.items():
                lines.append(f"  {field.alias or field_name}: {type_of(field)} = {default_of(field)}")
                lines += textwrap.wrap(
                    field.description or "", width, initial_indent=" " * 6, subsequent_indent=" " * 6
                )
    return "\n".join(lines).lstrip("\n") + "\n"
