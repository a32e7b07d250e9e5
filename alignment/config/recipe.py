"""YAML recipe -> validated `Recipe`.

Steps, each failing with a message that names the file and key:
  1. parse YAML (duplicate keys are errors: PyYAML would silently keep the last one),
  2. apply dotted overrides (`stages.dpo.train.beta=0.05`, values parsed as OmegaConf's dotlist does; a
     number indexes a list; a value, a mapping too, replaces what the recipe holds there),
  3. resolve `${name}`-style interpolation with OmegaConf; a whole value `${sft}` naming a stage is a
     *stage reference* (that stage's output) and is kept for step 5,
  4. validate our own keys with pydantic (unknown key -> "did you mean"), each stage by its kind,
  5. check stage references point to earlier stages (a later stage or a cycle is an error).
`align check` then does the deep checks (data columns, models, verifiers, TRL configs).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import Field, PrivateAttr, ValidationError, field_validator

from ..errors import UserError
from .base import Strict, did_you_mean, explain, stage_ref
from .evaluate import validate_evaluate_block
from .model import GgufSpec, LoraSpec, TemplateSpec, TinySpec, gguf_spec
from .stages import config_class
from .stages.base import StageConfig

_REF = re.compile(r"^\$\{([A-Za-z_][\w-]*)\}$")


class TinyModel(Strict):
    tiny: TinySpec = Field(
        description="a model built from scratch with a character-level tokenizer, with the recipe's "
        "seed, into <output_dir>/base (offline runs and tests)"
    )


class Recipe(Strict):
    name: str = Field(
        description="name of the run: output_dir defaults to outputs/<name>, and `${name}` "
        "interpolates it anywhere in the recipe"
    )
    model: str | TinyModel | GgufSpec = Field(
        description="the base model the first stage starts from: hub id, "
        "local folder, a .gguf file (or {gguf: FILE, package: REQUIREMENT}), or "
        "{tiny: {...}}"
    )
    output_dir: str | None = Field(
        None,
        description="folder holding every stage's output (<output_dir>/<stage>/), "
        "the base model built or converted for the run, and the evaluation; default: "
        "outputs/<name>",
    )
    seed: int = Field(
        42,
        description="the one seed of the run: data shuffling and built-in tasks, the tiny model's "
        "initial weights, TRL's seed and data_seed, PPO's and RSFT's sampling, the evaluation's",
    )
    lora: LoraSpec | None = Field(
        None,
        description="LoRA settings every stage trains with unless it gives its own "
        "`lora:` (`lora: null` in a stage: full fine-tuning there); default: none, every "
        "stage trains all weights",
    )
    template: TemplateSpec | None = Field(
        None,
        description="chat-template settings (system prompt, template variables) "
        "written into the tokenizer, so every stage renders prompts with them",
    )
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of every output's weights; auto: the dtype of the checkpoint a stage starts from"
    )
    trust_remote_code: bool = Field(
        False,
        description="run code shipped with a hub model or tokenizer (transformers' "
        "trust_remote_code) for every model the recipe loads; only for sources you trust",
    )
    report_to: str | list[str] = Field(
        "none",
        description="experiment trackers (e.g. wandb, tensorboard): TRL's "
        "report_to in TRL-backed stages, accelerate's log_with in ppo; none: only "
        "log_history.json",
    )
    stages: dict[str, Any] = Field(
        min_length=1,
        description="stage id -> that stage's keys (see its kind), run in the order written; `kind` defaults to the id",
    )
    evaluate: dict[str, Any] | None = Field(
        None, description="the evaluation run after the stages (see `evaluate:`); default: none"
    )

    @field_validator("model")
    @classmethod
    def _gguf_path(cls, value):
        return gguf_spec(value) or value

    # Set by load_recipe, not by the YAML.
    _path: Path | None = PrivateAttr(None)
    _overrides: tuple[str, ...] = PrivateAttr(())

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def overrides(self) -> tuple[str, ...]:
        """The dotted overrides the recipe was loaded with (a `--jobs` child gets the same)."""
        return self._overrides

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    @property
    def out(self) -> Path:
        return Path(self.output_dir or f"outputs/{self.name}")

    def stage_dir(self, stage_id: str) -> Path:
        return self.out / stage_id

    def base_model(self) -> str:
        """The recipe's model as a loadable name (the runner builds a tiny model, or converts a GGUF file,
        there on first use)."""
        if isinstance(self.model, (TinyModel, GgufSpec)):
            return str(self.out / "base")
        return self.model

    def resolve_model(self, value: str) -> str:
        """A model value: '${stage}' -> that stage's output folder; otherwise a path or hub id."""
        ref = stage_ref(value)
        return str(self.stage_dir(ref)) if ref else value

    def start_model(self, stage_id: str) -> str:
        """The policy a stage starts from: its own key, else the previous policy stage, else the base."""
        config: StageConfig = self.stages[stage_id]
        explicit = getattr(config, config.start_model_key())
        if explicit is not None:
            return self.resolve_model(explicit)
        order = list(self.stages)
        for earlier in reversed(order[: order.index(stage_id)]):
            if self.stages[earlier].produces_policy:
                return str(self.stage_dir(earlier))
        return self.base_model()

    def dependencies(self, stage_id: str) -> list[str]:
        """The stages whose output `stage_id` reads, in recipe order: every `${stage}` in its settings and
        the stage it starts from when it names none."""
        needed = {ref for _, ref in _refs_in(self.stages[stage_id].model_dump(), stage_id)}
        needed |= {s for s in self.stages if str(self.stage_dir(s)) == self.start_model(stage_id)}
        return [s for s in self.stages if s in needed]

    def lora_for(self, stage_id: str) -> LoraSpec | None:
        config = self.stages[stage_id]
        return config.lora if "lora" in config.model_fields_set else self.lora


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = Path(path)
    if not path.exists():
        raise UserError(f"recipe file '{path}' does not exist.")
    raw = _parse_yaml(path)
    raw = _apply_overrides(raw, overrides, path)
    resolved = _interpolate(raw, path)
    try:
        recipe = Recipe.model_validate({**resolved, "stages": resolved.get("stages") or {}})
    except ValidationError as error:
        raise UserError(f"{path}: {explain(error, Recipe)}") from None
    recipe._path = path
    recipe._overrides = tuple(overrides)
    recipe.stages = {sid: _validate_stage(sid, cfg, path) for sid, cfg in recipe.stages.items()}
    _check_references(recipe, path)
    if recipe.evaluate is not None:
        recipe.evaluate = validate_evaluate_block(recipe, path)
    return recipe


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (two stages with the same id, say), at any depth
    and in flow style too: PyYAML would silently keep the last value."""

    def construct_mapping(self, node, deep=False):
        first_mark: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then an explicit key is an override, not a duplicate
            key = self.construct_object(key_node, deep=deep)
            try:
                first = first_mark.get(key)
            except TypeError:
                continue  # an unhashable key: SafeLoader itself rejects it below
            if first is not None:
                raise UserError(
                    f"duplicate key '{key}' at {self._position(key_node.start_mark, first)} (first at "
                    f"{self._position(first, key_node.start_mark)}): a mapping holds one value per key; "
                    "rename or remove one."
                )
            first_mark[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    @staticmethod
    def _position(mark, other) -> str:
        """`line L`, with the column when `other` is on the same line (flow style: `{a: 1, a: 2}`)."""
        if mark.line == other.line:
            return f"line {mark.line + 1}, column {mark.column + 1}"
        return f"line {mark.line + 1}"


def _parse_yaml(path: Path) -> dict:
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except UserError as error:
        raise UserError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: YAML syntax error{where}: {getattr(error, 'problem', error)}.") from None
    if not isinstance(raw, dict):
        raise UserError(
            f"{path}: a recipe is a YAML mapping with 'name', 'model' and 'stages'; got {type(raw).__name__}."
        )
    return raw


def _apply_overrides(raw: dict, overrides, path: Path) -> dict:
    raw = copy.deepcopy(raw)
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value, item)
    return raw


def _parse_override(item: str) -> tuple[str, Any]:
    """(dotted key, value) of `key=value`; the value is parsed as OmegaConf's dotlist parses it (YAML, with
    `1e-4` a float), and a whole `${stage}` value stays a stage reference."""
    if "=" not in item or not item.split("=", 1)[0].strip():
        raise UserError(f"bad override '{item}': expected dotted.key=value, e.g. stages.sft.train.learning_rate=1e-4.")
    key, value = item.split("=", 1)
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([_escape_value(f"value={value}")]), resolve=False)
    except Exception as error:
        raise UserError(f"bad override '{item}': {str(error).splitlines()[0]}") from None
    return key.strip(), parsed["value"]


def _set_dotted(raw: dict, key: str, value: Any, item: str) -> None:
    """Set `value` at dotted `key` in place. A numeric part indexes a list (`evaluate.suites.0.data.dataset`);
    missing mapping keys are created (schema validation then names unknown ones). The value replaces what
    is there, a mapping included: `rename={}` empties the recipe's mapping instead of merging into it."""
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, ".".join(parts[:depth]), item)
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if last:
            node[part] = value
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}  # a new key, or a scalar replaced by a mapping (model=hub-id -> model.tiny.x=...)
            node = node[part]


def _list_index(items: list, part: str, list_key: str, item: str) -> int:
    if not part.isdigit():
        raise UserError(
            f"bad override '{item}': '{list_key}' is a list, so the key after it must be an index "
            f"({_indices(items)}), not '{part}'."
        )
    if int(part) >= len(items):
        raise UserError(
            f"bad override '{item}': index {part} is out of range: '{list_key}' has {len(items)} "
            f"item(s) ({_indices(items)}); an override can change an item, not add one."
        )
    return int(part)


def _indices(items: list) -> str:
    return f"indices 0 to {len(items) - 1}" if items else "no indices"


def _escape_value(item: str) -> str:
    key, value = item.split("=", 1)
    return f"{key}={_escape(value)}" if _REF.match(value.strip()) else item


def _escape(value: str) -> str:
    return "\\" + value


def _protect_stage_refs(value: Any, top_level: set[str]) -> Any:
    """Escape whole-value '${x}' that are not top-level keys, so OmegaConf leaves stage refs alone."""
    if isinstance(value, dict):
        return {k: _protect_stage_refs(v, top_level) for k, v in value.items()}
    if isinstance(value, list):
        return [_protect_stage_refs(v, top_level) for v in value]
    if isinstance(value, str):
        match = _REF.match(value)
        if match and match.group(1) not in top_level:
            return _escape(value)
    return value


def _interpolate(raw: dict, path: Path) -> dict:
    raw.setdefault("output_dir", "outputs/${name}")
    protected = _protect_stage_refs(raw, set(raw))
    try:
        return OmegaConf.to_container(OmegaConf.create(protected), resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", "") or ""
        message = str(error).splitlines()[0]
        raise UserError(f"{path}: cannot resolve interpolation in '{key}': {message}.") from None


def _validate_stage(stage_id: str, config: Any, path: Path) -> StageConfig:
    where = f"stages.{stage_id}"
    if not isinstance(config, dict):
        raise UserError(f"{path}: '{where}' must be a mapping of stage settings, got {config!r}.")
    kind = config.get("kind", stage_id)
    config_model = config_class(kind, where=f"{path}: {where}.kind" if "kind" in config else f"{path}: {where}")
    try:
        return config_model.model_validate({**config, "kind": kind})
    except ValidationError as error:
        raise UserError(f"{path}: {explain(error, config_model, prefix=where)}") from None


def _refs_in(value: Any, prefix: str):
    """(dotted key, stage id) for every stage reference inside a stage's settings."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _refs_in(v, f"{prefix}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _refs_in(v, f"{prefix}.{i}")
    elif stage_ref(value):
        yield prefix, stage_ref(value)


def _check_references(recipe: Recipe, path: Path) -> None:
    order = list(recipe.stages)
    graph = {sid: [ref for _, ref in _refs_in(cfg.model_dump(), sid)] for sid, cfg in recipe.stages.items()}
    for sid, config in recipe.stages.items():
        for key, ref in _refs_in(config.model_dump(exclude_defaults=False), f"stages.{sid}"):
            if ref not in recipe.stages:
                raise UserError(
                    f"{path}: '{key}' refers to '${{{ref}}}', which is not a stage{did_you_mean(ref, order)}; "
                    f"stages: {', '.join(order)}."
                )
            if ref == sid or _reaches(graph, ref, sid):
                cycle = " -> ".join([sid, ref] + ([sid] if ref != sid else []))
                raise UserError(
                    f"{path}: '{key}' creates a reference cycle ({cycle}); a stage can only use earlier stages."
                )
            if key == f"stages.{sid}.reward_model" and not recipe.stages[ref].scores_as_reward:
                raise UserError(
                    f"{path}: '{key}' names stage '{ref}' (kind {recipe.stages[ref].kind}), which makes no reward "
                    "model; name a `reward` stage (a Bradley-Terry classifier) or a `dpo` stage (its implicit reward)."
                )
            if order.index(ref) > order.index(sid):
                raise UserError(
                    f"{path}: '{key}' refers to '${{{ref}}}', which runs later; stages run in the order written, so "
                    f"move '{ref}' above '{sid}'."
                )


def _reaches(graph: dict[str, list[str]], start: str, target: str) -> bool:
    todo, seen = [start], set()
    while todo:
        node = todo.pop()
        if node == target:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(r for r in graph.get(node, []) if r in graph)
    return False
