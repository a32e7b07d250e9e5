"""Tool use in a stage's rollouts: the keys `tools:`, `environment:`, `max_turns`, `tool_format` and the limits on
tool output and time (torch-free; resolved by alignment/tools/registry.py, run by alignment/tools/rollout.py).

A stage that samples (rlvr) takes these keys through `ToolUse`, a mixin of its `Config`:

    tools: [calculator, {name: python, options: {timeout: 5}}, my_tools:lookup]
    environment: my_env:Shop          # optional: one instance per rollout, its methods are tools too
    environment: {openenv: {app: my_env:GuessEnv}}          # or an OpenEnv environment, served for the stage
    environment: {openenv: {url: http://127.0.0.1:8000}}    # or one already running (tools/openenv.py)
    max_turns: 4                      # assistant turns per rollout (a tool result between two of them)
    tool_format: hermes               # only for chat templates without tool support (ChatML, the tiny model)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from .base import ByName, Strict

TOOL_FORMATS = ("hermes", "llama3_json", "mistral")


class ToolSpec(ByName):
    """One entry of `tools:`; a bare string is shorthand for `{name: ...}`."""

    name: str = Field(description="built-in tool (calculator, python) or module:function (file next to the recipe)")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments bound to every call, "
        "hidden from the model (the python tool's timeout, memory_mb, output_chars)",
    )


class OpenEnvServer(Strict):
    """Where an OpenEnv environment runs: `url:` of a running server, or `app:` that the stage serves itself."""

    url: str | None = Field(None, description="http(s):// or ws(s):// address of a running OpenEnv server")
    app: str | None = Field(
        None,
        description="module:Class of an OpenEnv MCPEnvironment (or module:app, a FastAPI app of create_app), "
        "served on 127.0.0.1 in its own process for the stage",
    )
    max_sessions: int = Field(
        1024,
        ge=1,
        description="`app:` only: sessions the served environment holds at once (one per rollout of a batch that "
        "calls a tool)",
    )
    start_timeout: float = Field(
        180.0, gt=0, description="`app:` only: seconds the served environment may take to start"
    )
    timeout: float = Field(30.0, gt=0, description="seconds opening and resetting one session may take")

    @field_validator("url")
    @classmethod
    def _url(cls, value):
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise ValueError(f"'{value}' is not an http(s):// or ws(s):// address with a host")
        try:
            parts.port  # noqa: B018 - raises on a port that is no number
        except ValueError as error:
            raise ValueError(f"'{value}': {error}") from None
        return value.rstrip("/")

    @field_validator("app")
    @classmethod
    def _app(cls, value):
        if value is not None and (":" not in value or not all(value.partition(":")[::2])):
            raise ValueError(f"'{value}' is not of the form module:Class")
        return value

    @model_validator(mode="after")
    def _one_place(self):
        if (self.url is None) == (self.app is None):
            raise ValueError("give exactly one of `url:` (a running server) and `app:` (served for the stage)")
        served_only = self.model_fields_set & {"max_sessions", "start_timeout"}
        if self.url and served_only:
            raise ValueError(f"{', '.join(sorted(served_only))} only apply with `app:`")
        return self


class OpenEnvironment(Strict):
    """`environment: {openenv: {...}}`: an OpenEnv environment whose MCP tools are the model's tools."""

    openenv: OpenEnvServer = Field(description="where the environment runs: `url:` or `app:`")


# `environment:` is a string (module:Class) or a mapping (an OpenEnv environment): the value's type picks which, so
# an error names the one form given, not both. The mapping's tag is "" so that error paths read environment.openenv.
Environment = Annotated[
    Annotated[str, Tag("class")] | Annotated[OpenEnvironment, Tag("")],
    Discriminator(
        lambda value: "class" if isinstance(value, str) else "" if isinstance(value, dict | OpenEnvironment) else None,
        custom_error_type="environment_form",
        custom_error_message="expected module:Class or {openenv: {url: ...}} / {openenv: {app: module:Class}}",
    ),
]


class ToolUse(Strict):
    """Multi-turn rollouts with tools. No `tools:` and no `environment:` = single-turn sampling as before."""

    tools: list[ToolSpec] = Field(default_factory=list, description="tools the model may call during a rollout")
    environment: Environment | None = Field(
        None,
        description="module:Class with reset(row), tool methods and an optional reward(), one instance per "
        "rollout; or {openenv: {url: ...}} / {openenv: {app: module:Class}}, one OpenEnv session per rollout",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="assistant turns per rollout; a tool result follows each turn but the last that calls a tool",
    )
    tool_format: Literal[TOOL_FORMATS] | None = Field(
        None,
        description="how tool calls are written, for chat templates without tool support (default: the template's own)",
    )
    describe_tools: bool = Field(
        True,
        description="describe the tools in a system message (templates without tool "
        "support); false: the prompts stay as in the data, for a model taught the calls "
        "by demonstrations (a small context)",
    )
    max_tool_output_tokens: int = Field(
        256,
        gt=0,
        description="a tool result longer than this is cut, with a marker, and counted (truncated_tool_outputs)",
    )
    tool_timeout: float = Field(10.0, gt=0, description="seconds one tool call may take")
    max_tool_time: float = Field(60.0, gt=0, description="seconds all tool calls of one rollout may take together")
    max_tool_calls: int = Field(
        8,
        ge=1,
        description="tool calls (malformed ones included) run per assistant turn; "
        "the rest are not run: one error result says how many, counted (skipped_calls)",
    )
    max_step_tool_time: float | None = Field(
        600.0,
        gt=0,
        description="seconds all tool calls of one batch of "
        "rollouts may take together (rlvr: a generation step; rsft: a round's "
        "sampling; evaluation: a suite); later calls fail, counted as "
        "tool_errors; null: no bound",
    )

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools or self.environment)

    @model_validator(mode="after")
    def _tools_named(self):
        given = self.model_fields_set & {
            "max_turns",
            "tool_format",
            "max_tool_output_tokens",
            "tool_timeout",
            "max_tool_time",
            "describe_tools",
            "max_tool_calls",
            "max_step_tool_time",
        }
        if given and not self.uses_tools:
            raise ValueError(f"{', '.join(sorted(given))} only apply with `tools:` or `environment:`")
        return self
