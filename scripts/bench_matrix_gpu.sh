#!/usr/bin/env bash
# The never-worse matrix on a GPU: model shapes x host/device ratios x write x prefetch policies,
# each cell's L1+L2+L3 mean and p99 TTFT over the better of no cache and L1+L2, and a
# failing-store cell per model (docs/performance.md, "Never slower").
#
#   bash scripts/bench_matrix_gpu.sh OUTDIR
#
# The workload: 16 documents of 4,096 tokens, each queried 3 times in turn, against a device pool
# of a quarter of them (16,384 tokens); the host pool is RATIOS times the device pool. MODELS are
# 8b, 20 layers of 70b, and an MHA shape of our own (scripts/models/mha-13b-20-layers.json: 40 KV
# heads, 400 KiB of KV a token, 3.1x the 8B's). Each of MODELS, RATIOS, WRITES, PREFETCHES (comma
# lists) can be set in the environment to run part of the matrix within one session's GPU time.
# EXTRA adds options (--no-failing, --set path=value). Needs the package installed and one
# CUDA GPU; the store lives under a temporary directory.
set -euo pipefail
out=${1:?usage: bench_matrix_gpu.sh OUTDIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
l3=$(mktemp -d /tmp/hicache-matrix.XXXX)
trap 'rm -rf "$l3"' EXIT
hicache engine matrix --device cuda --backend file --config "{\"root\": \"$l3/store\"}" \
  --models "${MODELS:-8b,70b-layers,$here/models/mha-13b-20-layers.json}" \
  --ratios "${RATIOS:-0.5,1,2,4}" \
  --write-policies "${WRITES:-write_through,write_through_selective,write_back}" \
  --prefetch-policies "${PREFETCHES:-adaptive}" \
  --clients 16 --rounds 3 --set workload.document_tokens=4096 --set engine.device_tokens=16384 \
  --set page_size=64 --set workload.max_new_tokens=4 --set engine.host_layout=page_first \
  ${EXTRA:-} --json "$out/matrix.json" --details "$out/cells.jsonl" 2>&1 | tee "$out/matrix.log"
