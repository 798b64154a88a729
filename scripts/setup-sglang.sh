#!/usr/bin/env bash
# Install SGLang (pinned) without its GPU dependencies, for tests/sglang: the CPU-importable set
# of its dependencies comes from the "sglang-test" extra, sglang itself with --no-deps (its
# metadata pins a CUDA torch). torch stays at the build setup.sh installed. SGLang's page hash is
# a C++ extension built at first use: it needs g++, ninja and the OpenSSL headers.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v ninja >/dev/null || missing+=(ninja-build)
[ -f /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-sglang: install these Debian packages first (as root): ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
torch_pin=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${torch_pin}" >"$constraints"
.venv/bin/python -m pip install -q -c "$constraints" -e ".[sglang-test]"
.venv/bin/python -m pip install -q --no-deps "sglang==${SGLANG_VERSION}"
