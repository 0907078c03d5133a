#!/usr/bin/env bash
# Start N deepspeed launcher "nodes" on this one machine, one rank each, the way a real multi-node job
# without ssh starts them (--no_ssh --node_rank i), all talking to 127.0.0.1. Used by the tests.
#
#   bash launch/local_multinode.sh N SCRIPT [ARGS...]
#
# Environment: MASTER_PORT (default 29600), RANKS_PER_NODE (default 1), DSX_LAUNCH_DIR (hostfile and
# per-node logs, kept; default a fresh temporary directory, removed at exit once the logs are printed).
# Exits non-zero if any node fails, after printing that node's log.
set -euo pipefail
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
[[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && { usage; exit 0; }
[[ $# -ge 2 ]] || { usage >&2; echo "error: need N and SCRIPT" >&2; exit 2; }
nodes=$1; shift
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || { echo "error: N must be a positive integer, got '$nodes'" >&2; exit 2; }
port=${MASTER_PORT:-29600}
per_node=${RANKS_PER_NODE:-1}
if [[ -n "${DSX_LAUNCH_DIR:-}" ]]; then
  dir=$DSX_LAUNCH_DIR
  mkdir -p "$dir"
else
  dir=$(mktemp -d -t dsx-multinode.XXXXXX)
  trap 'rm -rf "$dir"' EXIT  # every node's log is printed below
fi
hostfile="$dir/hostfile"
: > "$hostfile"
for ((i = 0; i < nodes; i++)); do echo "node$i slots=$per_node" >> "$hostfile"; done
if [[ -z "${DS_ACCELERATOR:-}" ]] && ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR=cpu
fi
pids=()
for ((i = 0; i < nodes; i++)); do
  deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$i" --num_nodes "$nodes" \
    --master_addr 127.0.0.1 --master_port "$port" "$@" > "$dir/node$i.log" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < nodes; i++)); do
  if ! wait "${pids[$i]}"; then
    status=1
    echo "=== node $i failed; its log ($dir/node$i.log) ends with:" >&2
    tail -n 60 "$dir/node$i.log" >&2
  fi
done
for ((i = 0; i < nodes; i++)); do echo "=== node $i"; cat "$dir/node$i.log"; done
exit $status
