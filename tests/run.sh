#!/usr/bin/env bash
# README command 2: lint, format check, then the CPU test suite (gpu/multigpu tests skip with a reason).
#   . .venv/bin/activate && bash tests/run.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! command -v ruff >/dev/null 2>&1 || ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "tests/run.sh: ruff or pytest not found: run README command 1 first (bash launch/quickstart.sh), then . .venv/bin/activate" >&2
  exit 1
fi
ruff check .
ruff format --check .
# Two pytest processes (pytest-xdist, in the test extra) on a machine with two cores or more and no GPU: most of
# the suite's time is launched jobs starting their ranks. A file's tests stay in one process (--dist loadfile),
# so module fixtures such as the fault harness's clean runs are made once. On a GPU machine, or without xdist,
# the suite runs in one process (its GPU tests would share the card); "-n 0" after this script's name does the
# same, as --pdb needs.
workers=()
if "$PY" - >/dev/null 2>&1 <<'EOF'
import os
import sys

import torch
import xdist  # noqa: F401

sys.exit(0 if len(os.sched_getaffinity(0)) >= 2 and not torch.cuda.is_available() else 1)
EOF
then
  workers=(-n 2 --dist loadfile)
fi
"$PY" -m pytest -q -rs ${workers[@]+"${workers[@]}"} "$@"
