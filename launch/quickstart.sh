#!/usr/bin/env bash
# README command 1: set up a fresh machine and run the main job on its embedded default data.
#   bash launch/quickstart.sh [extra main-job flags, e.g. --steps 50]
# Creates .venv in the checkout, installs dsx, then trains the GPT through the deepspeed launcher on one
# device: the GPU when there is one, else the CPU (gloo). No downloads besides the Python packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.11,<2.14"          # CUDA build from the package index
  else
    pip install -q torch==2.13.0                # the CPU build (on this project's CPU machines it is on local disk)
  fi
fi
pip install -q -e ".[dali]" || pip install -q -e .   # DALI is optional: the torch loader yields the same batches
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec deepspeed --num_gpus 1 examples/gpt/train.py --deepspeed_config configs/gpt_zero2.json "$@"
else
  export DS_ACCELERATOR=cpu
  exec deepspeed --num_accelerators 1 examples/gpt/train.py --deepspeed_config configs/gpt_zero2.json "$@"
fi
