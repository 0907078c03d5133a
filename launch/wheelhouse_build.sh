#!/usr/bin/env bash
# Build an offline wheelhouse for an air-gapped cluster (run on a machine with network):
#   bash launch/wheelhouse_build.sh --out DIR [--python 3.12] [--platform manylinux_2_28_x86_64]
#                                   [--extras llm,gnn,gds] [--no-torch] [--only-project]
# DIR then holds wheels for the target Python/platform, DeepSpeed's sdist (it has no wheel on PyPI; it is
# built on the target without network), and a wheel of dsx itself. Install it with wheelhouse_install.sh.
set -euo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
out="" py=3.12 plat=manylinux_2_28_x86_64 extras="" torch=1 only=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2;; --python) py=$2; shift 2;; --platform) plat=$2; shift 2;;
    --extras) extras=$2; shift 2;; --no-torch) torch=0; shift;; --only-project) only=1; shift;;
    -h|--help) usage; exit 0;;
    *) echo "error: unknown option '$1'" >&2; usage >&2; exit 2;;
  esac
done
[[ -n "$out" ]] || { echo "error: --out DIR is required" >&2; usage >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
# dsx itself (pure Python + csrc sources; setuptools >= 77). setuptools' scratch build/ is removed before and
# after: files it kept from an earlier tree (a module since deleted) would otherwise land in the wheel.
rm -rf "$root/build"
pip wheel -q --no-deps --no-build-isolation -w "$out" "$root"
rm -rf "$root/build"
[[ $only == 1 ]] && { ls "$out"; exit 0; }
plats=(--platform "$plat" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform linux_x86_64)
reqs=$(python - "$root" "$extras" "$torch" <<'PY'
import sys, tomllib, pathlib
proj = tomllib.loads((pathlib.Path(sys.argv[1]) / "pyproject.toml").read_text())["project"]
reqs = [r for r in proj["dependencies"] if not r.startswith("deepspeed")]
if sys.argv[3] == "0":
    reqs = [r for r in reqs if not r.startswith("torch")]
for e in filter(None, sys.argv[2].split(",")):
    reqs += proj["optional-dependencies"][e]
print("\n".join(reqs))
PY
)
mapfile -t req_list <<< "$reqs"
# Resolve the whole dependency tree for the target interpreter, binary wheels only.
pip download -q --only-binary=:all: --python-version "$py" --implementation cp "${plats[@]}" -d "$out" \
  "${req_list[@]}" hjson py-cpuinfo psutil msgpack ninja packaging einops
pip download -q --no-deps --no-binary=:all: -d "$out" "deepspeed==0.19.*"
ls "$out" | wc -l | xargs echo "wheelhouse files:"
