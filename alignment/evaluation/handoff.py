"""Per-checkpoint evaluation results handed from `--jobs` evaluation processes to the run that writes the report.

Under `align run --jobs N` a checkpoint is evaluated in a process of its own as soon as it and its judges
(the reward model, the KL reference) exist, in a slot no stage is using (`run/jobs.py`). That process writes
what `evaluate_checkpoint` returns for it to `<output_dir>/.work/eval/<label>.json`; the evaluate block at the
end of the run reads those files instead of scoring the checkpoints again, then compares them with the
baseline and writes the report. A file is used only by the run that started the process which wrote it (its
`run` id) and only for the checkpoint folder as it was then (the mtime of its `stage.json` or `config.json`):
a later run scores everything again, so a changed verifier, data file or checkpoint is never read from a
stale result. The folder is removed once the report is written.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..runtime.files import write_atomic

RUN_ENV = "ALIGN_EVAL_RUN"  # the run id an evaluation process writes under (set by the run that starts it)


def stamp(path: str) -> int | None:
    """When the checkpoint at `path` was last written: its `stage.json` (a finished stage) or `config.json`."""
    for name in ("stage.json", "config.json"):
        file = Path(path) / name
        if file.exists():
            return file.stat().st_mtime_ns
    return None


@dataclass
class Handoff:
    """The results of one run's evaluation processes, in `folder`, under the run id `run`."""

    folder: Path
    run: str

    def _file(self, label: str) -> Path:
        return self.folder / f"{label}.json"

    def _key(self, label: str, path: str) -> dict:
        return {"run": self.run, "label": label, "path": str(path), "stamp": stamp(path)}

    def save(self, label: str, path: str, metrics: dict, rows: list[dict], main: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"key": self._key(label, path), "metrics": metrics, "rows": rows, "main": main}
        write_atomic(self._file(label), json.dumps(record, default=str))

    def load(self, label: str, path: str) -> tuple[dict, list[dict], dict] | None:
        """(metrics, per-sample rows, {suite: (texts, rm scores, per-prompt gold)}) as `evaluate_checkpoint`
        returns them, or None where this run has no result for the checkpoint as it is now."""
        file = self._file(label)
        if not file.exists():
            return None
        try:
            record = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if record.get("key") != self._key(label, path):
            return None
        return record["metrics"], record["rows"], {suite: tuple(v) for suite, v in record["main"].items()}

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
