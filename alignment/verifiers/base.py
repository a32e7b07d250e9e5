"""The verifier wrapper: call a plain function safely and turn what it returns into a result.

A verifier is a plain function ``def verify(completion: str, **example) -> float | None``
(docs/architecture.md, house rule 3): every dataset column arrives as a keyword, ``None`` means "could not parse the
completion" and a float is the reward (1.0 = correct, 0.0 = wrong; graded values are allowed). `Verifier` wraps
such a function once it is resolved (`registry.resolve`): it passes only the columns the function declares, binds
options, turns exceptions into error rows, and raises `UserError` for a missing column (details: `Verifier`).
Built-ins may return a `VerifyResult` to attach a detail string; a ``check_options(options)`` attribute is
called once by `resolve`, so bad option values fail at load time.

    >>> v = resolve("numeric")                      # from alignment.verifiers
    >>> v.score("so the answer is #### 42", {"answer": "42", "question": "..."})
    VerifyResult(reward=1.0, status='ok', detail=None)
    >>> summarize(v.score_batch(completions, examples))
    {'n': ..., 'pass_rate': ..., 'mean_reward': ..., 'unparseable_rate': ..., 'error_rate': ...}
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from alignment.errors import UserError

Status = Literal["ok", "unparseable", "error"]
STATUSES: tuple[str, ...] = ("ok", "unparseable", "error")


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of scoring one completion.

    reward: the reward used for training and metrics (0.0 when unparseable or error).
    status: "ok" (the function returned a number), "unparseable" (it returned None) or "error"
        (it raised, or returned something that is not a number).
    detail: why, for unparseable/error rows and for built-ins that explain a failure.
    """

    reward: float
    status: Status = "ok"
    detail: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"VerifyResult.status must be one of {STATUSES}, got {self.status!r}")


def _to_result(value: Any) -> VerifyResult:
    """Map what a verifier function returned to a VerifyResult."""
    if isinstance(value, VerifyResult):
        return value
    if value is None:
        return VerifyResult(0.0, "unparseable", None)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return VerifyResult(0.0, "error", f"returned {type(value).__name__} {value!r:.80}, expected a float or None")
    try:
        reward = float(value)  # bool, int, numpy/torch scalars, Fraction all qualify
    except (TypeError, ValueError) as exc:
        return VerifyResult(0.0, "error", f"returned {value!r:.80}, not convertible to float: {exc}")
    if not math.isfinite(reward):
        return VerifyResult(0.0, "error", f"returned a non-finite reward {reward}")
    return VerifyResult(reward, "ok", None)


def completion_text(completion: Any) -> str | None:
    """The text of a completion: a string, or the last message's content in chat format.

    TRL passes conversational completions as ``[{"role": "assistant", "content": "..."}]``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else None
    return None


@dataclass(frozen=True)
class _Signature:
    """What the wrapper needs to know about the function's parameters, computed once."""

    first: str  # name of the completion parameter (passed positionally)
    columns: tuple[str, ...] | None  # columns to pass; None = all (function takes **kwargs)
    required: tuple[str, ...]  # columns without default
    options: tuple[str, ...]  # parameters an option may set
    required_options: tuple[str, ...]  # keyword-only parameters without default
    var_keyword: bool


def inspect_function(fn: Callable, name: str) -> _Signature:
    """Read the function's signature; a function that cannot take a completion is a UserError."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise UserError(f"Verifier '{name}': cannot read the signature of {fn!r} ({exc}).") from None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in positional:
        raise UserError(
            f"Verifier '{name}' must take the completion as its first positional parameter, like "
            f"`def verify(completion: str, **example) -> float | None`; {fn!r} has signature "
            f"{inspect.signature(fn)}."
        )
    rest = params[1:]
    empty = inspect.Parameter.empty
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)
    cols = [p for p in rest if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    kwonly = [p for p in rest if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return _Signature(
        first=params[0].name,
        columns=None if var_kw else tuple(p.name for p in cols),
        required=tuple(p.name for p in cols if p.default is empty),
        options=tuple(p.name for p in cols + kwonly),
        required_options=tuple(p.name for p in kwonly if p.default is empty),
        var_keyword=var_kw,
    )


@dataclass(frozen=True)
class Verifier:
    """A resolved verifier: a function plus bound options. Build it with `resolve()`.

    name: the name as written in the recipe ("numeric", "my_verifiers:brevity").
    target: where the function lives ("alignment.verifiers.numeric:verify").
    fn: the raw function; options: keyword options bound to every call.

    Calling the function, it:

    - passes only the columns the function declares, unless it takes ``**kwargs`` (so
      ``def f(completion, answer)`` works on a dataset with ten columns);
    - binds recipe options (``options={"mode": "strict"}``) to the function's parameters; keyword-only
      parameters are options and are never filled from columns;
    - catches exceptions raised by the function: reward 0.0, status ``"error"``, detail
      ``"ExcType: message"``; a return value that is not a number (or None) is an error too;
    - raises `UserError` when a row lacks a column the function requires, because that is a data or
      recipe mistake, not a bad completion, and must not turn silently into zero rewards.
    """

    name: str
    fn: Callable[..., Any]
    options: Mapping[str, Any] = field(default_factory=dict)
    target: str = ""
    _sig: _Signature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "_sig", inspect_function(self.fn, self.name))

    @property
    def required_columns(self) -> tuple[str, ...]:
        """Dataset columns every row must have (parameters without default, not set by an option)."""
        return tuple(c for c in self._sig.required if c not in self.options)

    @property
    def parallel(self) -> bool:
        """True when rows are best scored concurrently (the function waits on subprocesses)."""
        return bool(getattr(self.fn, "parallel", False))

    def _kwargs(self, example: Mapping[str, Any]) -> dict[str, Any]:
        sig = self._sig
        missing = [c for c in self.required_columns if c not in example]
        if missing:
            raise UserError(
                f"Verifier '{self.name}' needs the column(s) {', '.join(map(repr, missing))}, but the "
                f"row has only {sorted(example) or 'no columns'}. Add the column to the dataset or "
                f"use a verifier that does not need it."
            )
        skip = set(self.options) | {sig.first}  # options win over columns; never pass completion twice
        if sig.columns is None:
            kwargs = {k: v for k, v in example.items() if k not in skip}
        else:
            kwargs = {k: example[k] for k in sig.columns if k in example and k not in skip}
        kwargs.update(self.options)
        return kwargs

    def score(self, completion: Any, example: Mapping[str, Any] | None = None) -> VerifyResult:
        """Score one completion against its dataset row (all columns, extra ones are fine)."""
        kwargs = self._kwargs(example or {})
        text = completion_text(completion)
        if text is None:
            return VerifyResult(0.0, "error", f"completion is {type(completion).__name__}, expected str")
        try:
            value = self.fn(text, **kwargs)
        except UserError:
            raise
        except Exception as exc:  # the user's function failed on this row: an error, not a crash
            return VerifyResult(0.0, "error", f"{type(exc).__name__}: {exc}"[:2000])
        return _to_result(value)

    def score_batch(
        self,
        completions: Sequence[Any],
        examples: Sequence[Mapping[str, Any]],
        max_workers: int | None = None,
    ) -> list[VerifyResult]:
        """Score completions[i] against examples[i]; parallel verifiers use a thread pool."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        workers = max_workers if max_workers is not None else (os.cpu_count() or 1) if self.parallel else 1
        if workers <= 1 or len(completions) <= 1:
            return [self.score(c, e) for c, e in zip(completions, examples, strict=True)]
        with ThreadPoolExecutor(max_workers=min(workers, len(completions))) as pool:
            return list(pool.map(self.score, completions, examples))


def summarize(results: Sequence[VerifyResult], threshold: float = 1.0) -> dict[str, float | int]:
    """Aggregate results: pass_rate (status ok and reward >= threshold), mean_reward (errors and
    unparseable count as 0.0), unparseable_rate, error_rate, n. Empty input gives zeros."""
    n = len(results)
    if n == 0:
        return {"n": 0, "pass_rate": 0.0, "mean_reward": 0.0, "unparseable_rate": 0.0, "error_rate": 0.0}
    passed = sum(1 for r in results if is_pass(r, threshold))
    return {
        "n": n,
        "pass_rate": passed / n,
        "mean_reward": sum(r.reward for r in results) / n,
        "unparseable_rate": sum(r.status == "unparseable" for r in results) / n,
        "error_rate": sum(r.status == "error" for r in results) / n,
    }


def is_pass(result: VerifyResult, threshold: float = 1.0) -> bool:
    """A pass is a parsed completion with full reward; 1e-9 slack absorbs float round-off."""
    return result.status == "ok" and result.reward >= threshold - 1e-9
