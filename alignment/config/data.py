"""DataSpec: where a stage's rows come from (a hub dataset, a local file or a built-in task).

Loading and column checks are in `alignment/data/loading.py`; a task's own keys (e.g. arithmetic's `n`) are
validated here against the task's `Params`.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, ValidationError, model_validator

from ..errors import UserError
from .base import Strict, did_you_mean, explain
from .tasks import task_params_model


DATA_FORMATS = ("hh",)


class DataSpec(Strict):
    """Where a stage's rows come from (see module docstring)."""

    model_config = ConfigDict(extra="allow")

    dataset: str | None = None
    task: str | None = None
    config: str | None = None
    split: str = "train"
    # `hh`: preference rows whose chosen/rejected are Anthropic HH-RLHF transcripts (alignment/pairs.py). A
    # task has its own `format` parameter (arithmetic's), so for a task the key is the task's.
    format: str | None = None
    rename: dict[str, str] = Field(default_factory=dict)
    shuffle: bool = True
    limit: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_source_and_known_keys(self):
        extra = dict(self.model_extra or {})
        if (self.dataset is None) == (self.task is None):
            raise ValueError("give exactly one of 'dataset' (hub id or local file) or 'task' (built-in task)")
        if self.task is None and extra:
            key = next(iter(extra))
            raise ValueError(
                f"unknown key '{key}'{did_you_mean(key, type(self).model_fields)}; "
                f"allowed keys: {', '.join(type(self).model_fields)}"
            )
        if self.task is None and self.format not in (None, *DATA_FORMATS):
            raise ValueError(f"unknown format '{self.format}'{did_you_mean(self.format.lower(), DATA_FORMATS)}; formats of "
                             f"a dataset: {', '.join(DATA_FORMATS)}")
        if self.task is not None:
            try:
                params_model = task_params_model(self.task)
            except UserError as error:
                raise ValueError(str(error)) from None
            try:
                params_model.model_validate(self._task_keys())
            except ValidationError as error:
                raise ValueError(explain(error, params_model, prefix=f"task {self.task}")) from None
        return self

    def task_params(self):
        return task_params_model(self.task).model_validate(self._task_keys())

    def _task_keys(self) -> dict:
        """The keys a task source hands its task: the unknown ones, and `format` when given."""
        keys = dict(self.model_extra or {})
        return (keys | {"format": self.format}) if self.format is not None else keys

    def describe(self) -> str:
        return f"task '{self.task}' ({self.split})" if self.task else f"'{self.dataset}' ({self.split})"
