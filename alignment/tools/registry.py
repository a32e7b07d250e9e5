"""Resolving a recipe's `tools:` and `environment:` to callables and the JSON schemas the model is shown.

    toolbox = resolve_tools([ToolSpec(name="calculator")], environment=None, search_dirs=[recipe_dir])
    toolbox.schemas            # [{"type": "function", "function": {"name": "calculator", ...}}]
    tools = toolbox.bind(toolbox.new_environment(row)[0])   # {name: callable} for one rollout

A tool is named like a verifier: a built-in key (`builtins.BUILTINS`) or `module:function` (a file next to the
recipe is found; it runs in the toolbox's worker process, tools/worker.py). It is described to the model by
transformers' `get_json_schema` (type hints on every argument, a Google-style docstring with an `Args:` section); one
that cannot be described is refused at `align check`; a call's arguments must fit that schema (`check_arguments`).

An environment (`environment: module:Class`, as TRL's `environment_factory`) is a class built without arguments, once
per rollout: `reset(row)` gets the dataset row (every column) before the first turn and may return text appended to
the last user message; the public methods its class defines are tools (only those: nothing it sets on itself); an
optional `reward()` scores the finished rollout (weight 1). So does `{openenv: ...}` (tools/openenv.py), by session.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType
from typing import Any

from transformers.utils import get_json_schema

from ..config.tools import OpenEnvironment, ToolSpec
from ..errors import UserError
from ..verifiers.registry import _load_target
from .builtins import BUILTINS
from .openenv import OpenEnvSession, connect
from .worker import ToolWorker, WorkerTool, bind_options, tool_name

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
        raise UserError(
            f"Tool '{name}' cannot be described to the model: {error}. A tool needs type hints on every "
            "argument and a Google-style docstring (a description, then `Args:` with one line per "
            "argument)."
        ) from None
    parameters = schema["function"].get("parameters", {})
    for key in hidden:
        parameters.get("properties", {}).pop(key, None)
        if key in parameters.get("required", []):
            parameters["required"].remove(key)
    schema["function"]["name"] = name
    return schema


def resolve_tool(spec: ToolSpec, search_dirs: list[Path]) -> tuple[Callable, dict]:
    """(callable taking the model's arguments, schema) of one `tools:` entry; a `module:function` tool is
    imported here for its schema and checked, and runs in the toolbox's worker process (`Toolbox.bind`)."""
    if spec.name in BUILTINS:
        try:
            fn = BUILTINS[spec.name](**spec.options)
        except TypeError as error:
            raise UserError(f"Tool '{spec.name}': bad `options:` ({error}).") from None
        return fn, schema_of(fn, spec.name)
    if ":" not in spec.name:
        raise UserError(
            f"Unknown tool '{spec.name}': the built-in tools are {', '.join(sorted(BUILTINS))}; your "
            "own is named as module:function (a .py file next to the recipe is found)."
        )
    fn = load_target(spec.name, "Tool", search_dirs)
    name = tool_name(spec.name)
    schema = schema_of(fn, name, hidden=tuple(spec.options))
    return bind_options(fn, name, spec.options), schema


def environment_methods(cls: type) -> list[str]:
    """The names of an environment class's public methods other than its hooks: its tools. Only methods the class
    defines count: a callable an instance keeps as an attribute (a grader, say) is no tool and cannot be called."""
    return [
        name
        for name in dir(cls)
        if not name.startswith("_")
        and name not in ENVIRONMENT_HOOKS
        and isinstance(inspect.getattr_static(cls, name), (FunctionType, staticmethod, classmethod))
    ]


def environment_tools(instance: Any, names: list[str] | None = None) -> dict[str, Callable]:
    """{name: the class's method bound to `instance`} of the environment's tools (`names`: those described)."""
    cls = type(instance)
    return {
        name: inspect.getattr_static(cls, name).__get__(instance, cls)
        for name in (environment_methods(cls) if names is None else names)
    }


def check_arguments(parameters: dict, arguments: dict) -> str | None:
    """Why `arguments` do not fit a tool's JSON schema `parameters` (unknown or missing names, a value of the
    wrong JSON type), or None when they do. Types are checked one level into arrays and objects."""
    properties = parameters.get("properties", {})
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        return f"unexpected argument(s) {', '.join(map(repr, unknown))}; it takes {', '.join(properties) or 'none'}"
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(map(repr, missing))}"
    for key, value in arguments.items():
        problem = _type_problem(properties[key], value)
        if problem:
            return f"argument '{key}' {problem}"
    return None


JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_problem(schema: dict, value) -> str | None:
    types = schema.get("type")
    if types is None:
        return None
    types = [types] if isinstance(types, str) else list(types)

    def fits(kind: str) -> bool:  # bool is an int in Python, never a JSON integer or number
        return kind not in JSON_TYPES or (
            isinstance(value, JSON_TYPES[kind]) and not (isinstance(value, bool) and kind in ("integer", "number"))
        )

    if not any(fits(kind) for kind in types):
        return f"must be of type {' or '.join(types)}, not {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            inner = _type_problem({k: v for k, v in schema["items"].items() if k != "items"}, item)
            if inner:
                return f"has an item that {inner}"
    return None


@dataclass
class Toolbox:
    """What a stage needs to run tools: the standalone tools, the environment class, every schema."""

    tools: dict[str, Callable] = field(default_factory=dict)
    schemas: list[dict] = field(default_factory=list)
    environment: Callable | None = None
    environment_names: list[str] = field(default_factory=list)  # the environment's described methods
    worker: ToolWorker | None = None  # runs the `module:function` tools (their entries in `tools` call it)

    @property
    def parameters(self) -> dict[str, dict]:
        """{tool name: the JSON schema of its arguments}, as the model is shown them."""
        return {s["function"]["name"]: s["function"].get("parameters", {}) for s in self.schemas}

    def new_environment(self, row: dict) -> tuple[Any, str | None]:
        """(a fresh environment reset to `row`, the text its reset returned) or (None, None)."""
        if self.environment is None:
            return None, None
        instance = self.environment()
        note = instance.reset(row)
        return instance, note if isinstance(note, str) and note else None

    def bind(self, instance: Any) -> dict[str, Callable]:
        """{tool name: callable} for one rollout: the standalone tools plus the environment's described methods."""
        if isinstance(instance, OpenEnvSession):
            return {**self.tools, **instance.tools(self.environment_names)}
        return {**self.tools, **(environment_tools(instance, self.environment_names) if instance is not None else {})}


def check_environment(factory: Any, target: str) -> list[dict]:
    """Schemas of an environment class's tools; refuses a class without reset or that cannot be built."""
    if not callable(factory):
        raise UserError(f"environment '{target}' is a {type(factory).__name__}, not a class.")
    if not callable(getattr(factory, "reset", None)):
        raise UserError(
            f"environment '{target}' has no reset(row) method: every rollout starts by resetting its "
            "own instance to the dataset row."
        )
    try:
        instance = factory()
    except Exception as error:  # noqa: BLE001 - the user's constructor
        raise UserError(
            f"environment '{target}': building an instance without arguments failed: {type(error).__name__}: {error}"
        ) from None
    methods = environment_tools(instance)
    if not methods:
        raise UserError(
            f"environment '{target}' has no public methods besides reset/reward, so it offers the model no tools."
        )
    return [schema_of(method, name) for name, method in methods.items()]


def resolve_tools(
    specs: list[ToolSpec], environment: str | OpenEnvironment | None, search_dirs: list[Path], where: str = "stage"
) -> Toolbox:
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
        if spec.name not in BUILTINS:  # the recipe's own code: in the worker process, where a timeout stops it
            toolbox.worker = toolbox.worker or ToolWorker([], search_dirs)
            toolbox.worker.targets.append((spec.name, spec.options))
            fn = WorkerTool(toolbox.worker, name)
        toolbox.tools[name] = fn
        toolbox.schemas.append(schema)
    if isinstance(environment, OpenEnvironment):  # served or reached now: its tools are what it lists
        connection = connect(environment.openenv, search_dirs, where)
        factory, schemas = connection.session_class(), connection.schemas
    elif environment:
        try:
            factory = load_target(environment, "Environment", search_dirs)
            schemas = check_environment(factory, environment)
        except UserError as error:
            raise UserError(f"{where}.environment: {error}") from None
    if environment:
        clash = sorted({s["function"]["name"] for s in schemas} & set(toolbox.tools))
        if clash:
            raise UserError(f"{where}.environment: method(s) {clash} have the name of a tool in `tools:`.")
        toolbox.environment = factory
        toolbox.environment_names = [s["function"]["name"] for s in schemas]
        toolbox.schemas += schemas
    return toolbox
