#!/usr/bin/env bash
# Set up and run the main job on the embedded default: benchmark the file backend in a temp dir.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hicache bench file "$@"
