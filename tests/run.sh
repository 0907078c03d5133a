#!/usr/bin/env bash
# README command 2: lint, format check, then the CPU test suite (gpu/multigpu tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
python -m pytest -q -rs "$@"
