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
# Two pytest processes (pytest-xdist, in the test extra) where the machine has two cores or more: most of the
# suite's time is launched jobs starting their ranks. A file's tests stay in one process (--dist loadfile), so
# module fixtures such as the fault harness's clean runs are made once. Without xdist the suite runs in one
# process; "-n 0" (after this script's name) does the same.
workers=()
if "$PY" -c "import xdist" >/dev/null 2>&1 && [ "$(nproc)" -ge 2 ]; then workers=(-n 2 --dist loadfile); fi
"$PY" -m pytest -q -rs "${workers[@]}" "$@"
