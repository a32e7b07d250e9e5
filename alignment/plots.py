"""PNG plots for evaluation reports: each metric across checkpoints, and training curves per stage.

Plots are drawn on `matplotlib.figure.Figure` objects saved by the Agg renderer, never through pyplot,
so no display, GUI backend or global figure state is involved (safe in tests and on servers).

    from alignment.plots import plot_metrics, plot_training_curves
    plot_metrics({"sft": {"arith/pass@1": 0.55}, "dpo": {"arith/pass@1": 0.61}}, Path("eval/metrics.png"))
    plot_training_curves({"sft": Path("outputs/quickstart/sft")}, Path("eval"))   # reads log_history.json
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

CURVE_WORDS = ("loss", "reward", "kl")  # which trainer-log keys are worth a curve
MAX_CURVES = 8
COLUMNS = 4


def _figure(panels: int, width: float = 3.6, height: float = 2.8):
    from matplotlib.figure import Figure  # saved to PNG by the Agg renderer; pyplot's backend is left alone

    cols = min(COLUMNS, panels)
    rows = math.ceil(panels / cols)
    figure = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = list(figure.subplots(rows, cols, squeeze=False).flat)
    for extra in axes[panels:]:
        extra.set_visible(False)
    return figure, axes[:panels]


def short_label(label: str, width: int = 18) -> str:
    return label if len(label) <= width else "…" + label[-(width - 1):]


def plot_metrics(metrics: dict[str, dict[str, float]], path: Path) -> Path | None:
    """One bar chart per metric ("SUITE/METRIC"), one bar per checkpoint, in one grid image."""
    names = list(dict.fromkeys(name for values in metrics.values() for name in values))
    if not names:
        return None
    labels = list(metrics)
    figure, axes = _figure(len(names))
    colors = [f"C{i % 10}" for i in range(len(labels))]
    for axis, name in zip(axes, names):
        values = [metrics[label].get(name, float("nan")) for label in labels]
        bars = axis.bar(range(len(labels)), values, color=colors)
        axis.bar_label(bars, fmt="%.3g", fontsize=6)
        axis.set_title(name, fontsize=9)
        axis.set_xticks(range(len(labels)), [short_label(l) for l in labels], rotation=30, ha="right", fontsize=7)
        axis.tick_params(axis="y", labelsize=7)
        axis.grid(axis="y", alpha=0.3)
    figure.savefig(path, dpi=100)
    return path


def curve_keys(history: list[dict]) -> list[str]:
    """Numeric log keys about loss, reward or KL (e.g. loss, eval_loss, rewards/margins, kl), in log order."""
    keys = dict.fromkeys(k for entry in history if isinstance(entry, dict) for k, v in entry.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and any(word in k.lower() for word in CURVE_WORDS))
    return list(keys)[:MAX_CURVES]


def plot_training_curves(folders: dict[str, Path], out_dir: Path) -> list[Path]:
    """`curves_<name>.png` for every folder holding a `log_history.json` (the runner writes one per stage)."""
    written = []
    for name, folder in folders.items():
        file = Path(folder) / "log_history.json"
        if not file.is_file():
            continue
        try:
            history = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        keys = curve_keys(history) if isinstance(history, list) else []
        if not keys:
            continue
        figure, axes = _figure(len(keys))
        for axis, key in zip(axes, keys):
            points = [(e.get("step", i), e[key]) for i, e in enumerate(history) if isinstance(e.get(key), (int, float))]
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None)
            axis.set_title(key, fontsize=9)
            axis.set_xlabel("step", fontsize=7)
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)
        figure.suptitle(f"{name} training curves", fontsize=10)
        path = out_dir / f"curves_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('_') or 'stage'}.png"
        figure.savefig(path, dpi=100)
        written.append(path)
    return written
