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
"$PY" -m pytest -q -rs "$@"
