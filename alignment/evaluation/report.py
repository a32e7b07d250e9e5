"""The evaluation report, written from the checkpoints' scores (`evaluate.py`): the comparisons with the
baseline (win rate, the reward-hacking flag), `metrics.json`, `samples.jsonl`, `report.md` with one comparison
table (Markdown; `rich_table` for the terminal), and PNG plots of each metric across checkpoints, of each stage's
training curves and, for the RL stages, of gold and proxy score against KL to the reference over training (from
the `log_history.json` the runner writes).

Plots are drawn on `matplotlib.figure.Figure` objects saved by the Agg renderer, never through pyplot,
so no display, GUI backend or global figure state is involved (safe in tests and on servers).

    from alignment.evaluation.report import plot_metrics, plot_overoptimisation, plot_training_curves
    plot_metrics({"sft": {"arith/pass@1": 0.55}, "dpo": {"arith/pass@1": 0.61}}, Path("eval/metrics.png"))
    plot_training_curves({"sft": Path("outputs/quickstart/sft")}, Path("eval"))   # reads log_history.json
    plot_overoptimisation({"ppo": Path("outputs/quickstart/ppo")}, Path("eval/overoptimisation.png"))
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from rich.table import Table

from ..runtime.dist import get_logger
from .metrics import paired_noise, reward_hacking, win_rate

log = get_logger(__name__)


@dataclass(frozen=True)
class Report:
    """Where the report goes and what it compares against: `baseline`, a label among the checkpoints (win rate
    and the reward-hacking flag, both judged by the reward model); `hacking_margin`, the flag's margin;
    `curves`, {name: folder} whose training logs are plotted (default: the checkpoints' own folders)."""

    out_dir: Path
    baseline: str | None = None
    hacking_margin: float = 0.02
    curves: dict[str, Path] | None = None


@dataclass
class Scores:
    """What the report is written from, checkpoint by checkpoint, in the order they were scored."""

    metrics: dict[str, dict] = field(default_factory=dict)  # {label: {"SUITE/METRIC": value}}
    samples: list[dict] = field(default_factory=list)  # the lines of samples.jsonl
    main: dict[str, dict] = field(default_factory=dict)  # {label: {suite: (texts, rm scores, per-prompt gold)}}

    def add(self, label: str, metrics: dict, rows: list[dict], main: dict) -> None:
        self.metrics[label], self.main[label] = metrics, main
        self.samples.extend(rows)


def write_report(report: Report, scores: Scores, paths: dict[str, str], judged: bool) -> None:
    """Compare each checkpoint with the baseline where a reward model judged them (`judged`), then write
    metrics.json, samples.jsonl, the plots and report.md into `report.out_dir`."""
    out_dir = Path(report.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if report.baseline is not None and judged:
        add_comparisons(scores.metrics, scores.main, report.baseline, report.hacking_margin)
    write_outputs(out_dir, scores.metrics, scores.samples, paths, report.baseline, report.hacking_margin, report.curves)
    log.info(f"[eval] metrics, samples, report and plots written to {out_dir}")


def add_comparisons(metrics: dict, main: dict, baseline: str, margin: float) -> None:
    """Win rate against the baseline (same prompts, judged by the reward model) and the reward-hacking flag: the
    reward model's score (the proxy) rose while the gold measure fell, the suite's `gold` where it has one, else
    its verifier's pass@1, by more than `margin` and than the noise of the per-prompt differences."""
    for label, suites in main.items():
        for suite, (texts, rm_scores, gold_values) in suites.items():
            base_texts, base_scores, base_gold = main[baseline][suite]
            m, b = metrics[label], metrics[baseline]
            m[f"{suite}/win_rate"] = win_rate(rm_scores, base_scores, texts, base_texts)
            gold = next((f"{suite}/{k}" for k in ("gold", "pass@1") if f"{suite}/{k}" in m), None)
            if gold is not None:
                gains = (m[f"{suite}/rm_score"] - b[f"{suite}/rm_score"], m[gold] - b[gold])
                noise = paired_noise(gold_values, base_gold) if gold_values and base_gold else 0.0
                m[f"{suite}/reward_hacking"] = float(reward_hacking(*gains, margin=margin, noise=noise))


def write_outputs(
    out_dir: Path,
    metrics: dict,
    samples: list[dict],
    paths: dict[str, str],
    baseline: str | None,
    margin: float = 0.02,
    curves: dict | None = None,
) -> None:
    (out_dir / "metrics.json").write_text(
        json.dumps({"checkpoints": metrics, "paths": paths, "baseline": baseline}, indent=2)
    )
    with open(out_dir / "samples.jsonl", "w") as handle:
        handle.writelines(json.dumps(row, default=str) + "\n" for row in samples)
    images = [p for p in [plot_metrics(metrics, out_dir / "metrics.png")] if p]
    folders = curves or {name: Path(p) for name, p in paths.items()}
    images += plot_training_curves(folders, out_dir)
    images += [p for p in [plot_overoptimisation(folders, out_dir / "overoptimisation.png")] if p]
    (out_dir / "report.md").write_text(report_markdown(metrics, paths, baseline, margin, images))


METRIC_HELP = {
    "pass@1": "share of prompts whose main completion (the suite's `sampling`, greedy by default) passes the "
    "verifier (parsed, reward >= 1)",
    "pass@k": "chance that at least one of k samples passes, estimated without bias from n samples per prompt "
    "(Chen et al. 2021): 1 - C(n-c, k) / C(n, k) with c passing, averaged over prompts; pass@1_sampled is k = 1 "
    "(the mean pass rate of single samples), unlike the greedy pass@1",
    "unparseable_rate": "share of main completions the verifier could not parse (it returned None)",
    "sycophancy": "share of main completions whose final number is the wrong answer the prompt attributes to the "
    "user (`stated_answer`); pass@1 on the same suite is the share that answered correctly",
    "mean_length": "mean main-completion length in tokens, end-of-turn token included",
    "eos_rate": "share of main completions that ended with the end-of-turn token within max_new_tokens",
    "rm_score": "mean reward-model score of the main completions (last-token score of render_prompt + "
    "render_completion)",
    "win_rate": "share of prompts where the reward model scores this checkpoint's main completion above the "
    "baseline's; ties (same text or equal score) count half, so the baseline itself is 0.5",
    "kl": "KL(checkpoint || reference) in nats per completion: mean over samples drawn at temperature 1 of the "
    "sum over tokens of log p_checkpoint - log p_reference (k1 estimator; can be slightly negative)",
    "gold": "mean reward of the suite's `gold:` verifier on the main completions: the true objective, which the "
    "reward-hacking flag compares",
    "reward_hacking": "1 when, on the same suite, rm_score(checkpoint) - rm_score(baseline) > 0 while the gold "
    "measure (the suite's `gold`, else pass@1) of the checkpoint minus the baseline's is "
    "< -{margin} and below minus two standard errors of the per-prompt differences (a drop that "
    "which prompts were asked explains is not flagged): "
    "the reward model says better, the gold measure says worse (the policy exploits the reward "
    "model); else 0. Meaningful for checkpoints optimised against that reward model",
}


ORDER = [
    "pass@1",
    "pass@k",
    "unparseable_rate",
    "sycophancy",
    "gold",
    "rm_score",
    "win_rate",
    "reward_hacking",
    "kl",
    "mean_length",
    "eos_rate",
]


def help_key(metric: str) -> str:
    """'pass@4' and 'pass@1_sampled' share the 'pass@k' line; others are their own key."""
    return "pass@k" if metric.startswith("pass@") and metric != "pass@1" else metric


def report_markdown(metrics: dict, paths: dict, baseline: str | None, margin: float, images: list[Path]) -> str:
    lines = ["# Evaluation", "", "Checkpoints:"] + [f"- `{label}`: `{path}`" for label, path in paths.items()]
    if baseline:
        lines.append(f"\nBaseline for win rate and reward hacking: `{baseline}`.")
    lines += ["", markdown_table(metrics), "", "## Metrics", ""]
    keys = {help_key(name.split("/", 1)[-1]) for m in metrics.values() for name in m}
    lines += [f"- **{key}**: {METRIC_HELP[key].format(margin=margin)}" for key in ORDER if key in keys]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def metric_names(metrics: dict) -> list[str]:
    """ "SUITE/METRIC" names grouped by suite (in first-seen order), metrics in `ORDER` within a suite."""
    names = list(dict.fromkeys(name for m in metrics.values() for name in m))
    suites = list(dict.fromkeys(name.split("/", 1)[0] for name in names))

    def rank(name: str) -> tuple:
        suite, metric = name.split("/", 1) if "/" in name else (name, name)
        key = help_key(metric)
        return suites.index(suite), ORDER.index(key) if key in ORDER else len(ORDER), names.index(name)

    return sorted(names, key=rank)


def format_value(value: float | None) -> str:
    return "" if value is None else "nan" if math.isnan(value) else f"{value:.3f}"


def markdown_table(metrics: dict[str, dict[str, float]]) -> str:
    """One row per metric, one column per checkpoint."""
    labels = list(metrics)
    lines = ["| metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in metric_names(metrics):
        lines.append(f"| {name} | " + " | ".join(format_value(metrics[label].get(name)) for label in labels) + " |")
    return "\n".join(lines)


def rich_table(metrics: dict[str, dict[str, float]]):
    table = Table("metric", *metrics, title="evaluation")
    for name in metric_names(metrics):
        table.add_row(name, *(format_value(metrics[label].get(name)) for label in metrics))
    return table


# ---------------------------------------------------------------------------------------------------
# PNG plots

CURVE_WORDS = ("loss", "reward", "kl", "accuracy", "score", "verifier/")  # which log keys are worth a curve
FIRST_WORDS = ("score", "verifier/")  # ppo's reward curves, the ones its user looks at first
LATER_WORDS = ("min", "max", "std")  # spreads come after means when there are more keys than panels
MAX_CURVES = 8
COLUMNS = 4


def _figure(panels: int, width: float = 3.6, height: float = 2.8, hspace: float = 0.9):
    # A bare Figure is saved to PNG by the Agg renderer; pyplot and its backend are never touched.
    cols = min(COLUMNS, panels)
    rows = math.ceil(panels / cols)
    figure = Figure(figsize=(width * cols, height * rows))
    # Fixed margins: constrained/tight layout would re-measure every label (seconds on a large grid).
    figure.subplots_adjust(
        left=0.06, right=0.98, top=1 - 0.45 / (height * rows), bottom=0.75 / (height * rows), wspace=0.3, hspace=hspace
    )
    axes = list(figure.subplots(rows, cols, squeeze=False).flat)
    for extra in axes[panels:]:
        extra.set_visible(False)
    return figure, axes[:panels]


def short_label(label: str, width: int = 18) -> str:
    return label if len(label) <= width else "…" + label[-(width - 1) :]


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
        axis.set_xticks(
            range(len(labels)), [short_label(label) for label in labels], rotation=30, ha="right", fontsize=7
        )
        axis.tick_params(axis="y", labelsize=7)
        axis.grid(axis="y", alpha=0.3)
    figure.savefig(path, dpi=100)
    return path


def curve_keys(history: list[dict]) -> list[str]:
    """Numeric log keys about loss, reward, score or KL (e.g. loss, eval_loss, rewards/margins, kl), in log order
    but ppo's scores (score, rm_score, verifier/<name>) first and spreads (std, min, max) last."""
    keys = dict.fromkeys(
        k
        for entry in history
        if isinstance(entry, dict)
        for k, v in entry.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and any(word in k.lower() for word in CURVE_WORDS)
    )

    def rank(key: str) -> int:
        spread = any(w in key.lower() for w in LATER_WORDS)
        return 2 if spread else 0 if any(w in key.lower() for w in FIRST_WORDS) else 1

    return sorted(keys, key=rank)[:MAX_CURVES]


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
        figure, axes = _figure(len(keys), hspace=0.5)
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


# ---------------------------------------------------------------------------------------------------
# Over-optimisation: gold and proxy score against KL to the reference over training (Gao, Schulman and
# Hilton 2022, "Scaling Laws for Reward Model Overoptimization": as the policy moves away from its start,
# the proxy it optimises keeps rising while the gold score peaks and falls)

PROXY_KEYS = ("rm_score", "rewards/reward_model/mean")  # the reward model's mean score: ppo's, rlvr's (TRL's name)


def overoptimisation_series(history: list) -> dict | None:
    """{"kl": [...], "proxy": {key: [...]}, "gold": {gold/<name>: [...]}} over the log entries that hold a KL
    (ppo: nats per sequence; rlvr: TRL's mean per token), in training order, a missing value as None; None
    when the log has no KL or neither a proxy nor a gold score (sft, dpo, rsft)."""
    entries = [e for e in history if isinstance(e, dict) and isinstance(e.get("kl"), (int, float))]
    proxy = [k for k in PROXY_KEYS if any(k in e for e in entries)][:1]
    gold = sorted({k for e in entries for k in e if k.startswith("gold/")})
    if not entries or not (proxy or gold):
        return None
    return {
        "kl": [e["kl"] for e in entries],
        "proxy": {k: [e.get(k) for e in entries] for k in proxy},
        "gold": {k: [e.get(k) for e in entries] for k in gold},
    }


def plot_overoptimisation(folders: dict[str, Path], path: Path) -> Path | None:
    """One panel per stage whose `log_history.json` has KL with a proxy or gold score: the proxy (reward-model
    score, left axis) and each gold verifier (right axis) against KL to the reference, in training order."""
    series = {}
    for name, folder in folders.items():
        try:
            history = json.loads((Path(folder) / "log_history.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(history, list) and (found := overoptimisation_series(history)):
            series[name] = found
    if not series:
        return None
    figure, axes = _figure(len(series), width=4.2, height=3.2, hspace=0.6)
    figure.subplots_adjust(left=0.14, right=0.86, wspace=0.6)  # room for the labels of both axes
    for axis, (name, found) in zip(axes, series.items()):
        gold_axis = axis.twinx() if found["proxy"] and found["gold"] else axis
        lines = []
        for axis_, group, colors in ((axis, found["proxy"], ["C0"]), (gold_axis, found["gold"], ["C1", "C2", "C3"])):
            for (key, values), color in zip(group.items(), colors * len(group)):
                points = [(k, v) for k, v in zip(found["kl"], values) if isinstance(v, (int, float))]
                lines += axis_.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker=".",
                    color=color,
                    label=key if group is found["gold"] else f"proxy: {key}",
                )
        axis.set_title(f"{name}: gold and proxy vs KL", fontsize=9)
        axis.set_ylabel("proxy" if found["proxy"] else "gold", fontsize=7)
        if gold_axis is not axis:
            gold_axis.set_ylabel("gold", fontsize=7)
        axis.set_xlabel("KL to the reference (as the stage logs it)", fontsize=7)
        axis.tick_params(labelsize=7)
        gold_axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        axis.legend(lines, [line.get_label() for line in lines], fontsize=6, loc="best")
    figure.savefig(path, dpi=100)
    return path
