"""Resolving a recipe's `tools:` and `environment:` to callables and the JSON schemas the model is shown.

    toolbox = resolve_tools([ToolSpec(name="calculator")], environment=None, search_dirs=[recipe_dir])
    toolbox.schemas            # [{"type": "function", "function": {"name": "calculator", ...}}]
    tools = toolbox.bind(toolbox.new_environment(row)[0])   # {name: callable} for one rollout

A tool is named like a verifier: a built-in key (`builtins.BUILTINS`) or `module:function` (a file next to the
recipe is found). It is described to the model by transformers' `get_json_schema` (type hints on every argument,
a Google-style docstring with an `Args:` section); one that cannot be described is refused at `align check`.

An environment (`environment: module:Class`, as TRL's `environment_factory`) is a class built without arguments,
once per rollout: `reset(row)` gets the dataset row (every column) before the first turn and may return text
appended to the last user message; its public methods are tools; an optional `reward()` scores the finished
rollout (the stage adds it to the verifiers' reward with weight 1).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.utils import get_json_schema

from ..config.tools import ToolSpec
from ..errors import UserError
from ..verifiers.registry import _load_target
from .builtins import BUILTINS

ENVIRONMENT_HOOKS = ("reset", "reward")


def load_target(target: str, what: str, search_dirs: list[Path]) -> Any:
    """`module:attribute` imported the way verifiers are (the recipe's folder first); errors say `what`."""
    try:
        return _load_target(target, target, search_dirs)
    except UserError as error:
        # The verifier loader's messages name a verifier and a function; say what this is.
        raise UserError(str(error).replace("Verifier '", f"{what} '", 1)) from None


def schema_of(fn: Callable, name: str, hidden: tuple[str, ...] = ()) -> dict:
    """transformers' tool schema of `fn`, without the arguments in `hidden` (bound from the recipe)."""
    try:
        schema = get_json_schema(fn)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException
        raise UserError(f"Tool '{name}' cannot be described to the model: {error}. A tool needs type hints on every "
                        "argument and a Google-style docstring (a description, then `Args:` with one line per "
                        "argument).") from None
    parameters = schema["function"].get("parameters", {})
    for key in hidden:
        parameters.get("properties", {}).pop(key, None)
        if key in parameters.get("required", []):
            parameters["required"].remove(key)
    schema["function"]["name"] = name
    return schema


def bind_options(fn: Callable, name: str, options: dict) -> Callable:
    """`fn` with the recipe's options as fixed keyword arguments; an option `fn` does not take is an error."""
    if not options:
        return fn
    parameters = inspect.signature(fn).parameters
    unknown = [k for k in options if k not in parameters]
    if unknown:
        raise UserError(f"Tool '{name}' has no argument(s) {', '.join(map(repr, unknown))} to bind from `options:`; "
                        f"its arguments: {', '.join(parameters) or 'none'}.")

    def bound(**arguments):
        return fn(**arguments, **options)

    bound.__name__, bound.__doc__ = name, fn.__doc__
    return bound


def resolve_tool(spec: ToolSpec, search_dirs: list[Path]) -> tuple[Callable, dict]:
    """(callable taking the model's arguments, schema) of one `tools:` entry."""
    if spec.name in BUILTINS:
        try:
            fn = BUILTINS[spec.name](**spec.options)
        except TypeError as error:
            raise UserError(f"Tool '{spec.name}': bad `options:` ({error}).") from None
        return fn, schema_of(fn, spec.name)
    if ":" not in spec.name:
        raise UserError(f"Unknown tool '{spec.name}': the built-in tools are {', '.join(sorted(BUILTINS))}; your "
                        "own is named as module:function (a .py file next to the recipe is found).")
    fn = load_target(spec.name, "Tool", search_dirs)
    name = spec.name.rpartition(":")[2].rpartition(".")[2]
    schema = schema_of(fn, name, hidden=tuple(spec.options))
    return bind_options(fn, name, spec.options), schema


def environment_tools(instance: Any) -> dict[str, Callable]:
    """The public methods of an environment instance other than its hooks: its tools."""
    return {name: getattr(instance, name) for name in dir(instance)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS and callable(getattr(instance, name))}


@dataclass
class Toolbox:
    """What a stage needs to run tools: the standalone tools, the environment class, every schema."""

    tools: dict[str, Callable] = field(default_factory=dict)
    schemas: list[dict] = field(default_factory=list)
    environment: Callable | None = None

    def new_environment(self, row: dict) -> tuple[Any, str | None]:
        """(a fresh environment reset to `row`, the text its reset returned) or (None, None)."""
        if self.environment is None:
            return None, None
        instance = self.environment()
        note = instance.reset(row)
        return instance, note if isinstance(note, str) and note else None

    def bind(self, instance: Any) -> dict[str, Callable]:
        """{tool name: callable} for one rollout: the standalone tools plus the environment's methods."""
        return {**self.tools, **(environment_tools(instance) if instance is not None else {})}


def check_environment(factory: Any, target: str) -> list[dict]:
    """Schemas of an environment class's tools; refuses a class without reset or that cannot be built."""
    if not callable(factory):
        raise UserError(f"environment '{target}' is a {type(factory).__name__}, not a class.")
    if not callable(getattr(factory, "reset", None)):
        raise UserError(f"environment '{target}' has no reset(row) method: every rollout starts by resetting its "
                        "own instance to the dataset row.")
    try:
        instance = factory()
    except Exception as error:  # noqa: BLE001 - the user's constructor
        raise UserError(f"environment '{target}': building an instance without arguments failed: "
                        f"{type(error).__name__}: {error}") from None
    methods = environment_tools(instance)
    if not methods:
        raise UserError(f"environment '{target}' has no public methods besides reset/reward, so it offers the "
                        "model no tools.")
    return [schema_of(method, name) for name, method in methods.items()]


def resolve_tools(specs: list[ToolSpec], environment: str | None, search_dirs: list[Path],
                  where: str = "stage") -> Toolbox:
    """The `Toolbox` of a stage's `tools:` and `environment:`; every error names the recipe key."""
    toolbox = Toolbox()
    for index, spec in enumerate(specs):
        try:
            fn, schema = resolve_tool(spec, search_dirs)
        except UserError as error:
            raise UserError(f"{where}.tools.{index}: {error}") from None
        name = schema["function"]["name"]
        if name in toolbox.tools:
            raise UserError(f"{where}.tools.{index}: a second tool named '{name}'.")
        toolbox.tools[name] = fn
        toolbox.schemas.append(schema)
    if environment:
        try:
            factory = load_target(environment, "Environment", search_dirs)
            schemas = check_environment(factory, environment)
        except UserError as error:
            raise UserError(f"{where}.environment: {error}") from None
        clash = sorted({s["function"]["name"] for s in schemas} & set(toolbox.tools))
        if clash:
            raise UserError(f"{where}.environment: method(s) {clash} have the name of a tool in `tools:`.")
        toolbox.environment = factory
        toolbox.schemas += schemas
    return toolbox
