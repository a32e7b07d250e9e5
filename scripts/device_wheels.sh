#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), the wheels the GPU machine lacks to run scripts/bench.py: its image has
# torch, transformers, peft, accelerate, pandas, pyarrow, rich, typer, but not these (Python 3.12 there).
# Then, with the device tool: run scripts/device_bench.sh with `.whl` carried. About 10 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  trl==1.16.0 datasets==5.2.0 dill multiprocess omegaconf==2.4.0 antlr4-python3-runtime \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection \
  math-verify==0.9.0 latex2sympy2_extended
du -sh .whl
