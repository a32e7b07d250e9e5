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

    dataset: str | None = Field(
        None,
        description="Hugging Face Hub dataset id, or a local .json/.jsonl/.parquet/.csv "
        "file or folder of them (as given, or relative to the recipe's folder); give this or "
        "`task`",
    )
    task: str | None = Field(
        None,
        description="built-in offline task (`arithmetic`, `tool_arithmetic`, `reasoning_gym`) whose rows are "
        "generated from the recipe's seed; its parameters are further keys of this mapping; give this or `dataset`",
    )
    config: str | None = Field(
        None,
        description="configuration (subset) name of a hub dataset, passed to "
        "datasets.load_dataset; default: the dataset's own; an error on local files",
    )
    split: str = Field(
        "train",
        description="split of a hub dataset; in a local folder, the files named after it "
        "(`train_sft.jsonl`, `train_sft-00000-of-00001.parquet`); a single local file holds one split "
        "(`train` or the file's own name, anything else is an error); a task gives its test problems for "
        "`test`, `eval` or `heldout`, its validation problems for `validation` (with the task's "
        "`validation_fraction`) and its training problems otherwise",
    )
    format: str | None = Field(
        None,
        description="`hh`: preference rows whose chosen/rejected are whole Anthropic "
        "HH-RLHF transcripts, read as chat turns (also detected, with a log line); for a task "
        "source, the task's own `format` parameter",
    )
    rename: dict[str, str] = Field(
        default_factory=dict,
        description="{old: new} column renames, applied first, to map "
        "a dataset's columns onto those the stage needs; an unknown column is an error",
    )
    shuffle: bool = Field(True, description="shuffle the rows with the recipe's seed (after `rename`, before `limit`)")
    limit: int | None = Field(
        None, gt=0, description="keep only the first `limit` rows (after shuffling); default: every row"
    )

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
            raise ValueError(
                f"unknown format '{self.format}'{did_you_mean(self.format.lower(), DATA_FORMATS)}; formats of "
                f"a dataset: {', '.join(DATA_FORMATS)}"
            )
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
