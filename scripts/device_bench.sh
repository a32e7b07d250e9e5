#!/usr/bin/env bash
# On a lent GPU machine (the device tool, `.whl` carried: see scripts/device_wheels.sh): install the
# missing wheels, then run the benchmark at the given size (default 0.5b) into $OUT (default ./bench-out).
#   run: bash scripts/device_bench.sh 0.5b      carry: [".whl"]      timeout_s: 590
# A second argument replaces the list of SECTION:SECONDS jobs, e.g. the samplers side by side in a call of
# their own: bash scripts/device_bench.sh 0.5b decode:540
set -uo pipefail
size="${1:-0.5b}"
jobs="${2:-rollout:150 static:150 sft:90 dpo,ppo:150}"
out="${OUT:-bench-out}"
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$out/gpu.txt"
python3 -c "import torch, transformers, trl, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)" | tee "$out/versions.txt"
# Sections in separate processes, so one failing (or running out of its time) leaves the others' figures;
# dpo and ppo share one, where the bench adds PPO's peak GPU memory over DPO-LoRA's. The limits add up
# to 540 s, within one device call (600 s).
for job in $jobs; do
  section="${job%%:*}" limit="${job##*:}"
  name="bench-$size-${section//,/-}"  # plain file names: the device tool may not bring back others
  timeout "$limit" python3 scripts/bench.py --size "$size" --sections "$section" --json "$out/$name.json" \
    2>&1 | tail -40 | tee "$out/$name.log"
done
