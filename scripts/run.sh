#!/usr/bin/env bash
# Set up and run the main job on the embedded default: the conformance suite on the file backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hicache check "$@"
