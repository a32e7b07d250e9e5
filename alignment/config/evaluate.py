"""The `evaluate:` block of a recipe and the suites of `align eval`: specs and their validation.

Running them is `alignment/evaluation/evaluate.py`; this module only reads and checks what the recipe says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from ..errors import UserError
from .base import Strict, did_you_mean, explain, stage_ref
from .data import DataSpec
from .sampling import SamplingSpec
from .tools import ToolUse

SUITE_NAME = r"^[\w.@-]+$"


def greedy() -> SamplingSpec:
    return SamplingSpec(temperature=0.0, max_new_tokens=16)


class PassAtKSpec(SamplingSpec):
    """`pass_k:` n sampled completions per prompt; pass@k for every k in `k` (k <= n)."""

    n: int = Field(8, gt=1, description="samples per prompt (the n of the unbiased pass@k estimator)")
    temperature: float = Field(
        1.0,
        gt=0,
        description="sampling temperature of these samples (> 0: pass@k needs "
        "distinct samples); at 1 with top_p 1 and top_k 0 they also serve the KL estimate",
    )
    k: list[int] = Field(
        default_factory=list,
        description="the k of each pass@k reported (1 <= k <= n; pass@1 "
        "from these samples is `pass@1_sampled`); default: powers of two up to n, and n",
    )
    limit: int | None = Field(None, gt=0, description="sample only the suite's first `limit` prompts (saves time)")

    @model_validator(mode="after")
    def _k_within_n(self):
        self.k = sorted(set(self.k)) or sorted({2**i for i in range(self.n.bit_length())} | {self.n})
        if not all(1 <= k <= self.n for k in self.k):
            raise ValueError(f"every k must be between 1 and n = {self.n}; got k = {self.k}")
        return self


# What a suite's pass_k block takes from its `sampling` block unless it sets it: the length, the batch and the sampler.
INHERITED_BY_PASS_K = (
    "max_new_tokens",
    "batch_size",
    "backend",
    "vllm",
    "engine",
    "cache",
    "compile",
    "merge_lora",
    "dtype",
    "draw",
)


class SuiteSpec(ToolUse):
    name: str = Field(pattern=SUITE_NAME, description="prefix of the suite's metric names")
    data: DataSpec = Field(
        description="the suite's prompts (`prompt` or `messages`) and the columns its verifier reads"
    )
    verifier: str | None = Field(
        None,
        description="verifier key or module:function scoring each completion (pass@1, unparseable rate); default: none",
    )
    verifier_options: dict[str, Any] = Field(
        default_factory=dict, description="options (keyword-only parameters) of that verifier"
    )
    gold: str | None = Field(
        None,
        description="verifier (key or module:function) whose mean reward on the main "
        "completions is the suite's gold measure (metric `gold`); where given, the reward-hacking "
        "flag compares it instead of pass@1",
    )
    gold_options: dict[str, Any] = Field(
        default_factory=dict, description="options (keyword-only parameters) of the gold verifier"
    )
    sampling: SamplingSpec = Field(
        default_factory=greedy,
        description="the main completion, one per prompt (default: greedy, temperature 0, max_new_tokens 16)",
    )
    pass_k: PassAtKSpec | None = Field(
        None,
        description="also sample n completions per prompt for pass@k (unbiased "
        "estimator, Chen et al. 2021, arXiv:2107.03374); max_new_tokens, batch_size and "
        "the sampler (backend, vllm, engine, cache, compile, merge_lora, dtype, draw) default to "
        "`sampling`'s",
    )

    @model_validator(mode="after")
    def _one_main_completion(self):
        if self.sampling.n != 1:
            raise ValueError("sampling.n must be 1 (one completion per prompt); use pass_k: {n: ...} for several")
        if self.pass_k is not None:  # pass@k samples as long and on the same sampler as the main completions,
            for key in INHERITED_BY_PASS_K:  # unless told otherwise
                if key not in self.pass_k.model_fields_set:
                    setattr(self.pass_k, key, getattr(self.sampling, key))
        return self


# The compact suites fit the quickstart's character-level model (bare answers, a few tokens); the chat suites a
# pretrained instruct model: prompts phrased for it, and room for "37 + 48 = 85." and what it says around that
# (SmolLM2-135M-Instruct's zero-shot answers often restate the problem in a paragraph and answer in the next:
# a few-token budget would cut off many of them).
BUILTIN_SUITES: dict[str, dict] = {
    "arithmetic": {
        "data": {"task": "arithmetic", "split": "test", "n": 200},
        "verifier": "arithmetic",
        "sampling": {"temperature": 0, "max_new_tokens": 16},
    },
    "arithmetic-sycophancy": {
        "data": {"task": "arithmetic", "split": "test", "n": 200, "style": "sycophancy"},
        "verifier": "arithmetic",
        "sampling": {"temperature": 0, "max_new_tokens": 16},
    },
    "arithmetic-chat": {
        "data": {"task": "arithmetic", "split": "test", "n": 200, "phrasing": "chat"},
        "verifier": "arithmetic",
        "sampling": {"temperature": 0, "max_new_tokens": 128},
    },
    "arithmetic-chat-sycophancy": {
        "data": {"task": "arithmetic", "split": "test", "n": 200, "phrasing": "chat", "style": "sycophancy"},
        "verifier": "arithmetic",
        "sampling": {"temperature": 0, "max_new_tokens": 128},
    },
}


def builtin_suite(name: str) -> dict:
    if name not in BUILTIN_SUITES:
        raise UserError(
            f"unknown suite '{name}'{did_you_mean(name, BUILTIN_SUITES)}; built-in suites: "
            f"{', '.join(BUILTIN_SUITES)} (or give a YAML file of suites, or a data file with --verifier)."
        )
    return {"name": name, **json.loads(json.dumps(BUILTIN_SUITES[name]))}


class EvaluateSpec(Strict):
    after: list[str] | None = Field(None, description="stages to evaluate (default: every policy stage)")
    include_base: bool = Field(False, description="also evaluate the recipe's base model, labelled `base`")
    suites: list[SuiteSpec] = Field(
        min_length=1,
        description="suite mappings or names of built-in suites ("
        "arithmetic, arithmetic-sycophancy, arithmetic-chat, arithmetic-chat-sycophancy)",
    )
    reward_model: str | None = Field(
        None,
        description="'${rm}' (a reward or dpo stage), a path or hub id of a reward model "
        "that scores the main completions (rm_score; win_rate with a baseline)",
    )
    baseline: str | None = Field(None, description="stage id, '${stage}', 'base' or a path: win rate is against it")
    reference: str | None = Field(
        None,
        description="stage id, '${stage}', 'base' or a path: the `kl` "
        "metric is KL(checkpoint || it) per sequence, on the checkpoint's own samples at "
        "temperature 1 (the reference itself: 0, no samples drawn)",
    )
    reward_hacking_margin: float = Field(
        0.02,
        ge=0,
        description="pass@1 drop below the baseline's beyond "
        "which a reward-model score above the baseline's is flagged `reward_hacking` "
        "(the drop must also exceed two standard errors of the per-prompt "
        "differences)",
    )
    batch_size: int = Field(64, gt=0, description="sequences per forward pass when scoring (reward model, KL)")
    output: str = Field(
        "eval", description="folder, under output_dir, for metrics.json, samples.jsonl, report.md and the plots"
    )

    @field_validator("suites", mode="before")
    @classmethod
    def _builtin_names(cls, value):
        if isinstance(value, list):
            try:
                return [builtin_suite(v) if isinstance(v, str) else v for v in value]
            except UserError as error:
                raise ValueError(str(error)) from None
        return value

    @model_validator(mode="after")
    def _unique_names(self):
        names = [s.name for s in self.suites]
        if len(set(names)) != len(names):
            raise ValueError(f"suite names must be unique; got {names}")
        return self


def validate_evaluate_block(recipe, path: Path) -> EvaluateSpec:
    try:
        spec = EvaluateSpec.model_validate(recipe.evaluate)
    except ValidationError as error:
        raise UserError(f"{path}: {explain(error, EvaluateSpec, prefix='evaluate')}") from None
    for stage_id in spec.after or []:
        if stage_id not in recipe.stages:
            raise UserError(
                f"{path}: evaluate.after names '{stage_id}', which is not a stage"
                f"{did_you_mean(stage_id, recipe.stages)}; stages: {', '.join(recipe.stages)}."
            )
        if not recipe.stages[stage_id].produces_policy:
            raise UserError(
                f"{path}: evaluate.after names '{stage_id}', a reward model; list policy stages there "
                "and give the reward model as evaluate.reward_model."
            )
    for key in ("baseline", "reference", "reward_model"):
        stage_id = named_stage(recipe, getattr(spec, key), f"{path}: evaluate.{key}")
        if stage_id is None:
            continue
        stage = recipe.stages[stage_id]
        if not (stage.scores_as_reward if key == "reward_model" else stage.produces_policy):
            wanted = "a reward or dpo stage (kind: reward, dpo)" if key == "reward_model" else "a policy stage"
            raise UserError(
                f"{path}: evaluate.{key} names stage '{stage_id}' (kind {recipe.stages[stage_id].kind}); "
                f"it must be {wanted}."
            )
    return spec


def named_stage(recipe, value: str | None, where: str) -> str | None:
    """The stage a model value names ('${sft}' or a bare stage id), else None (a path, hub id or 'base')."""
    ref = stage_ref(value)
    if ref is not None and ref not in recipe.stages:
        raise UserError(
            f"{where}: '{value}' is not a stage{did_you_mean(ref, recipe.stages)}; stages: {', '.join(recipe.stages)}."
        )
    return ref or (value if value in recipe.stages else None)


def model_of(recipe, value: str | None) -> tuple[str, str] | None:
    """(label, path) of a baseline/reference/reward-model value."""
    if value is None:
        return None
    stage_id = named_stage(recipe, value, "evaluate")
    if stage_id is not None:
        return stage_id, str(recipe.stage_dir(stage_id))
    return ("base", recipe.base_model()) if value == "base" else (value, value)


def cli_suites(
    values: list[str],
    verifier: str | None = None,
    n: int | None = None,
    k: list[int] | None = None,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
) -> tuple[list[SuiteSpec], Path]:
    """`--suite` values -> suites: built-in names, YAML files of suites, or data files (verifier: --verifier).
    `max_new_tokens` overrides every suite's main, pass@k (and so KL) sampling; `temperature` the main
    completions' only, since pass@k needs its own sampling temperature. Returns the suites and the folder
    relative data paths are read from."""
    raw, base_dir = [], Path.cwd()
    for value in values:
        path = Path(value)
        if path.suffix in (".yaml", ".yml"):
            if not path.exists():
                raise UserError(f"--suite: file '{value}' does not exist.")
            loaded = yaml.safe_load(path.read_text())
            loaded = loaded.get("suites") if isinstance(loaded, dict) else loaded
            if not isinstance(loaded, list):
                raise UserError(f"--suite {value}: expected a list of suites (or a mapping with 'suites:').")
            raw += loaded
            base_dir = path.parent
        elif path.suffix in (".json", ".jsonl", ".csv", ".parquet"):
            raw.append({"name": path.stem, "data": {"dataset": value}})
        else:
            raw.append(value)
    suites = []
    for item in raw:
        if not isinstance(item, (str, dict)):
            raise UserError(
                f"--suite: a suite is a built-in name or a mapping with name, data, verifier; got {item!r}."
            )
        item = builtin_suite(item) if isinstance(item, str) else dict(item)
        if verifier and not item.get("verifier"):
            item["verifier"] = verifier
        if limit and isinstance(item.get("data"), dict):
            item["data"] = {**item["data"], "limit": limit}
        if n or k:
            item["pass_k"] = {**(item.get("pass_k") or {}), "n": n or max(k), **({"k": k} if k else {})}
        override_sampling(item, max_new_tokens, temperature)
        try:
            suites.append(SuiteSpec.model_validate(item))
        except ValidationError as error:
            raise UserError(f"--suite: {explain(error, SuiteSpec, prefix=str(item.get('name', 'suite')))}") from None
    return suites, base_dir


def override_sampling(item: dict, max_new_tokens: int | None, temperature: float | None) -> None:
    """Apply `align eval --max-new-tokens/--temperature` to one raw suite mapping; a block that is not a
    mapping is left for SuiteSpec's validation to name."""
    main = {k: v for k, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature)) if v is not None}
    if main and isinstance(item.get("sampling") or {}, dict):
        item["sampling"] = {**(item.get("sampling") or {}), **main}
    if max_new_tokens is not None and isinstance(item.get("pass_k"), dict):
        item["pass_k"] = {**item["pass_k"], "max_new_tokens": max_new_tokens}
