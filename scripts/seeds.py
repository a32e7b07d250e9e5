"""Run a recipe (the quickstart by default) over several seeds and tabulate its evaluation per stage.

    python scripts/seeds.py                                  # seeds 1 2 3, `--jobs 2`, outputs/seeds/
    python scripts/seeds.py --seeds 1 2 3 4 5 --jobs 1       # the stages one after another
    python scripts/seeds.py --table-only                     # re-tabulate finished runs

Each seed runs `align run RECIPE --jobs J seed=S output_dir=OUT/seed-S` (a finished seed is skipped, as
the runner skips finished stages) and its `eval/metrics.json` is read back. Writes OUT/seeds.md and
OUT/seeds.json: per stage and metric the mean, min and max over the seeds, and per seed the gain of every
stage over `--baseline` in points of the headline metric, with the machine, the command and the wall time
of each run. The quickstart figures of docs/results.md (and the README's table) come from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METRICS = [
    "arithmetic/pass@1",
    "arithmetic/pass@1_sampled",
    "arithmetic/pass@8",
    "arithmetic/rm_score",
    "arithmetic/kl",
    "sycophancy/sycophancy",
]


def machine() -> str:
    """The CPU's model name and core count: seeded figures repeat on the same CPU, not on another."""
    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.exists()
        else []
    )
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def run_seed(recipe: Path, seed: int, out: Path, jobs: int, threads: int) -> None:
    """Run one seed unless it has finished; its wall time, --jobs and threads go to OUT/seed-S/wall_s.json."""
    if (out / "eval" / "metrics.json").exists():
        return
    command = [
        sys.executable,
        "-m",
        "alignment",
        "run",
        str(recipe),
        "--jobs",
        str(jobs),
        f"seed={seed}",
        f"output_dir={out}",
    ]
    print(f"seed {seed}: {' '.join(command[1:])}", flush=True)
    started = time.time()
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        stdout=open(out.with_suffix(".log"), "w"),
        stderr=subprocess.STDOUT,
    )
    if done.returncode != 0:
        sys.exit(f"seed {seed} failed (exit {done.returncode}); its log: {out.with_suffix('.log')}")
    (out / "wall_s.json").write_text(
        json.dumps({"wall_s": round(time.time() - started, 1), "jobs": jobs, "threads": threads})
    )


def tabulate(runs: dict[int, dict], baseline: str, headline: str) -> tuple[str, dict]:
    """Markdown tables (mean [min, max] per stage and metric; gains per seed) and the same as a dict."""
    stages = list(next(iter(runs.values())))
    summary = {}
    for metric in METRICS:
        for stage in stages:
            values = [run[stage][metric] for run in runs.values() if metric in run[stage]]
            if values:
                summary.setdefault(metric, {})[stage] = {
                    "mean": statistics.fmean(values),
                    "min": min(values),
                    "max": max(values),
                }
    lines = [
        f"| metric (mean [min, max] over seeds {', '.join(map(str, runs))}) | " + " | ".join(stages) + " |",
        "|---" * (len(stages) + 1) + "|",
    ]
    for metric, per_stage in summary.items():
        cells = [
            f"{s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]" if (s := per_stage.get(stage)) else ""
            for stage in stages
        ]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    trained = [s for s in stages if s not in (baseline, "base")]  # the gains of the stages after the baseline
    gains = {
        seed: {stage: 100 * (run[stage][headline] - run[baseline][headline]) for stage in trained}
        for seed, run in runs.items()
    }
    lines += [
        "",
        f"| seed | {baseline} {headline} | " + " | ".join(f"{s} (points)" for s in trained) + " |",
        "|---" * (len(trained) + 2) + "|",
    ]
    for seed, run in runs.items():
        lines.append(
            f"| {seed} | {run[baseline][headline]:.3f} | "
            + " | ".join(f"{gains[seed][s]:+.1f}" for s in trained)
            + " |"
        )
    lines.append("| min | | " + " | ".join(f"{min(g[s] for g in gains.values()):+.1f}" for s in trained) + " |")
    return "\n".join(lines), {"summary": summary, "gains_points": gains}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", type=Path, default=REPO / "recipes" / "quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--jobs", type=int, default=2, help="the runner's --jobs (2: two stages at a time)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for the run (the machine's cores)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "seeds")
    parser.add_argument("--baseline", default="sft")
    parser.add_argument("--headline", default="arithmetic/pass@1")
    parser.add_argument("--table-only", action="store_true", help="tabulate finished seeds, run nothing")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        if not args.table_only:
            run_seed(args.recipe.resolve(), seed, args.out / f"seed-{seed}", args.jobs, args.threads)
    runs = {
        seed: json.loads(path.read_text())["checkpoints"]
        for seed in args.seeds
        if (path := args.out / f"seed-{seed}" / "eval" / "metrics.json").exists()
    }
    if not runs:
        sys.exit(f"no finished seed under {args.out}")
    records = {
        seed: json.loads(path.read_text())
        for seed in runs
        if (path := args.out / f"seed-{seed}" / "wall_s.json").exists()
    }
    modes = {(r["jobs"], r["threads"]) for r in records.values()} or {(args.jobs, args.threads)}
    table, data = tabulate(runs, args.baseline, args.headline)
    where = machine()
    header = (
        f"`{args.recipe.relative_to(REPO) if args.recipe.is_relative_to(REPO) else args.recipe}`, "
        + ", ".join(f"`--jobs {jobs}`, OMP_NUM_THREADS={threads}" for jobs, threads in sorted(modes))
        + f", on {where}; wall per seed: "
        + ", ".join(f"{s}: {r['wall_s']:.0f} s" for s, r in records.items())
        + "\n"
    )
    (args.out / "seeds.md").write_text(header + "\n" + table + "\n")
    (args.out / "seeds.json").write_text(json.dumps({"machine": where, "runs": records, **data}, indent=1))
    print(header + "\n" + table)
    return data


if __name__ == "__main__":
    main()
