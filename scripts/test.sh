#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite: the command CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
.venv/bin/python -m pytest "$@"
