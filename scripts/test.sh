#!/usr/bin/env bash
# Set up (servers included), lint, type-check and run the whole test suite: the command CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-servers.sh
bash scripts/setup-sglang.sh
# The third-party example package: tests/test_example_thirdparty.py needs its entry point.
.venv/bin/python -m pip install -q -e examples/thirdparty --no-deps --no-build-isolation
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
bash scripts/docs.sh
.venv/bin/python -m pytest "$@"
