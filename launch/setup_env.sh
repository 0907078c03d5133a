#!/usr/bin/env bash
# The install step of README command 1 and of CI: .venv in the checkout with torch, dsx (editable) with the
# extras the tests need, and DALI when it installs. Run it, then `. .venv/bin/activate`.
#   bash launch/setup_env.sh
# Environment: PYTHON (the interpreter that makes .venv, default python3); DSX_SKIP_DALI=1 leaves DALI out
# (the main job then uses its torch loader, which yields the same batches).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv || { echo "setup: '$PY -m venv' failed: install the venv module (Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
fi
. .venv/bin/activate
# setuptools: the build backend pyproject.toml names, also for builds without isolation (the wheel test)
pip install -q --upgrade pip "setuptools>=77"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.11,<2.14"          # CUDA build from the package index
  else
    # the CPU build: PyPI's Linux wheel is the CUDA one, several GB (this project's CPU machines have it on disk)
    # (one retry: offline, each of torch's dependencies would otherwise wait out five before the fallback)
    pip install -q --retries 1 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 || pip install -q torch==2.13.0
  fi
fi
pip install -q -e ".[test,gnn]"
if [[ "${DSX_SKIP_DALI:-0}" == "1" ]]; then
  echo "setup: DALI left out (DSX_SKIP_DALI=1): the main job uses its torch loader"
elif ! pip install -q -e ".[dali]" >.venv/dali-install.log 2>&1; then
  echo "setup: nvidia-dali did not install (optional; see .venv/dali-install.log): the main job uses its torch loader"
fi
echo "setup: .venv ready ($(python -c 'import torch; print("torch", torch.__version__)'))"
