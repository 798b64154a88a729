#!/usr/bin/env bash
# Set up (servers included), lint, type-check and run the whole test suite: the command CI runs.
# The vLLM tests run last, in .venv-vllm (scripts/setup-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-servers.sh
bash scripts/setup-sglang.sh
bash scripts/setup-vllm.sh
# The third-party example package: tests/test_example_thirdparty.py needs its entry point.
.venv/bin/python -m pip install -q -e examples/thirdparty --no-deps --no-build-isolation
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
bash scripts/docs.sh
bash scripts/asan.sh  # the native I/O helper, built with AddressSanitizer, under its tests
# One worker per core (HICACHE_TEST_WORKERS to change); each file runs whole on one worker, so a
# module's fixtures (test_teeth's 55 suite runs, a built wheel) are made once. Files are handed out
# in collection order (tests/conftest.py puts the longest-limited first), not by test count, which
# would leave the one-test whole-suite files for last.
.venv/bin/python -m pytest -n "${HICACHE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  "$@"
# tests/vllm: real vLLM on CPU, in its own venv (the run above leaves that folder out). Engines log
# a lot, so passed tests' output is not replayed.
.venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider \
  -n "${HICACHE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  -o addopts="-ra --strict-markers --durations=15"
