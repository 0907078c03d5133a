#!/usr/bin/env bash
# Several nodes without ssh: run this on EVERY node, each with its own NODE_RANK (0 on the master):
#   NODE_RANK=i MASTER_ADDR=<node 0 address> bash launch/multinode_nossh.sh HOSTFILE SCRIPT --deepspeed_config CONFIG [ARGS...]
# HOSTFILE lists all nodes (see launch/hostfile.example); the launcher on each node starts its local ranks.
set -euo pipefail
usage() { sed -n '2,4p' "$0" | sed 's/^# //'; }
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { usage; exit 0; }
[[ $# -ge 2 ]] || { usage >&2; exit 2; }
hostfile=$1; shift
[[ -f "$hostfile" ]] || { echo "error: hostfile '$hostfile' not found (see launch/hostfile.example)" >&2; exit 2; }
: "${NODE_RANK:?set NODE_RANK to this node's index in the hostfile (0 for the master)}"
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's address}"
nodes=$(grep -cvE '^\s*(#|$)' "$hostfile")
exec deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$NODE_RANK" --num_nodes "$nodes" \
  --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" "$@"
