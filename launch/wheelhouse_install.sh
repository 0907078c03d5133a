#!/usr/bin/env bash
# Install dsx from an offline wheelhouse, with no network:
#   bash launch/wheelhouse_install.sh DIR [--venv PATH] [--system-site-packages] [--no-deps]
# Installs into the active environment, or into a new venv at PATH (--no-deps: only what DIR holds, for a
# house built with --only-project on top of a preinstalled stack). DeepSpeed is built from its sdist
# without build isolation (its ops are JIT-compiled on first use).
set -euo pipefail
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { usage; exit 0; }
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
dir=$(cd "$1" && pwd) || { echo "error: wheelhouse '$1' not found" >&2; exit 2; }; shift
venv="" sys_site="" nodeps=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --venv) venv=$2; shift 2;; --system-site-packages) sys_site=--system-site-packages; shift;;
    --no-deps) nodeps=--no-deps; shift;;
    *) echo "error: unknown option '$1'" >&2; exit 2;;
  esac
done
if [[ -n "$venv" ]]; then python3 -m venv $sys_site "$venv"; . "$venv/bin/activate"; fi
shopt -s nullglob
ds=("$dir"/deepspeed-*.tar.gz)
if [[ ${#ds[@]} -gt 0 ]]; then
  DS_BUILD_OPS=0 pip install -q --no-index --find-links "$dir" --no-build-isolation "${ds[0]}"
fi
pip install -q --no-index --find-links "$dir" $nodeps dsx
python -c "import importlib.metadata as m; print('dsx', m.version('dsx'), 'installed from $dir')"
