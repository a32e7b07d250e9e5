"""The sections of scripts/bench.py, one module each, and what they share.

`common` holds the row format, the peak-memory timer and the warm-up every sampling section makes; `models`
builds the model a run measures; `table` prints the results. Each section module has one entry point,
`bench_<section>(model_dir, size, args[, work]) -> list[dict]`, whose rows `scripts/bench.py` collects in the
order of its sections. The package is imported with scripts/ on `sys.path` (bench.py puts it there).
"""
