#!/usr/bin/env bash
# One node, N GPUs:  bash launch/single_node.sh N SCRIPT --deepspeed_config CONFIG [ARGS...]
#   e.g. bash launch/single_node.sh 8 examples/gpt/train.py --deepspeed_config configs/gpt_zero3.json
set -euo pipefail
usage() { sed -n '2,3p' "$0" | sed 's/^# //'; }
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { usage; exit 0; }
[[ $# -ge 2 ]] || { usage >&2; exit 2; }
n=$1; shift
exec deepspeed --num_gpus "$n" --master_port "${MASTER_PORT:-29500}" "$@"
