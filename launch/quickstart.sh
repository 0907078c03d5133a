#!/usr/bin/env bash
# README command 1: set up a fresh machine and run the main job on its embedded default data.
#   bash launch/quickstart.sh [extra main-job flags, e.g. --steps 50]
# Creates .venv in the checkout with everything README command 2 (tests/run.sh) needs (launch/setup_env.sh),
# then trains the GPT through the deepspeed launcher on one device: the GPU when there is one, else the CPU
# (gloo), with dsx's activation offload planning what leaves the device (configs/gpt_quickstart.json; the plan
# is printed after the profiled step). No downloads besides the Python packages. DSX_SKIP_DALI=1 installs
# without DALI.
set -euo pipefail
# (before the setup: --help must not build .venv first)
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0; }
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
. .venv/bin/activate
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec deepspeed --num_gpus 1 examples/gpt/train.py --deepspeed_config configs/gpt_quickstart.json "$@"
else
  export DS_ACCELERATOR=cpu
  exec deepspeed --num_accelerators 1 examples/gpt/train.py --deepspeed_config configs/gpt_quickstart.json "$@"
fi
