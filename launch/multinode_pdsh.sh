#!/usr/bin/env bash
# Several nodes started from one of them over ssh (pdsh):
#   bash launch/multinode_pdsh.sh HOSTFILE SCRIPT --deepspeed_config CONFIG [ARGS...]
# Needs passwordless ssh to every host in HOSTFILE, pdsh installed, and the same checkout + environment
# at the same path on every node (a shared filesystem, or the offline wheelhouse on each).
set -euo pipefail
usage() { sed -n '2,5p' "$0" | sed 's/^# //'; }
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { usage; exit 0; }
[[ $# -ge 2 ]] || { usage >&2; exit 2; }
hostfile=$1; shift
[[ -f "$hostfile" ]] || { echo "error: hostfile '$hostfile' not found (see launch/hostfile.example)" >&2; exit 2; }
command -v pdsh >/dev/null || { echo "error: pdsh is not installed (apt-get install pdsh), or use multinode_nossh.sh" >&2; exit 2; }
master=$(awk '!/^#/ && NF {print $1; exit}' "$hostfile")
exec deepspeed --hostfile "$hostfile" --launcher pdsh --master_addr "${MASTER_ADDR:-$master}" \
  --master_port "${MASTER_PORT:-29500}" "$@"
