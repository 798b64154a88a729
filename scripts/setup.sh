#!/usr/bin/env bash
# Create .venv (if needed) and install the project with its test tools and every backend's client
# library. torch is pinned here only to pick the CPU build on this machine; the package itself
# asks torch>=2.4. The servers the tests start come from scripts/setup-servers.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,docs,metrics,redis,s3,3fs,fsspec-s3,gpu]"
