#!/usr/bin/env bash
# The tier engine on a GPU, Llama-3-8B shape in bf16: the figures of docs/performance.md.
#
#   bash scripts/bench_engine_gpu.sh OUTDIR [STEP...]   (steps: prefix multiturn documents
#                                                       mooncake; default all)
#
# Needs the package (with the mooncake extra) installed and one CUDA GPU. Writes to OUTDIR:
# prefix.json (a 32k-token prefix from the host against PCIe + suffix compute), and for each
# workload the four-configuration comparison (.json, .png): multi-turn conversations and long
# documents with L3 = file on local disk, and multi-turn with L3 = Mooncake (a master and a
# segment holder started here on 127.0.0.1, stopped by PID at exit).
set -euo pipefail
out=${1:?usage: bench_engine_gpu.sh OUTDIR [STEP...]}
shift
steps=${*:-prefix multiturn documents mooncake}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
l3=$(mktemp -d /tmp/hicache-engine-l3.XXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$l3"
}
trap cleanup EXIT

want() { [[ " $steps " == *" $1 "* ]]; }

if want prefix; then
  python3 "$here/bench_engine_prefix.py" --prefix 32768 --suffix 64 --json "$out/prefix.json"
fi

# Plots need matplotlib; without it, draw them later from the JSON (plot_ttft_by_round).
plot() { python3 -c 'import matplotlib' 2>/dev/null && echo "--plot=$out/$1.png" || true; }

common=(--model 8b --device cuda --set page_size=64 --set engine.chunk_tokens=8192
        --set workload.max_new_tokens=4 --set workload.concurrency=4 --set prefetch.policy=timeout
        --set write.policy=write_through)
multiturn=(--workload multiturn --clients 12 --rounds 5 --set workload.system_tokens=256
           --set 'workload.turn_tokens=[1024,2048]' --set engine.device_tokens=40960
           --set engine.host_tokens=65536)
documents=(--workload documents --clients 8 --rounds 5 --set workload.document_tokens=8192
           --set workload.question_tokens=64 --set engine.device_tokens=36864
           --set engine.host_tokens=81920)

if want multiturn; then
  hicache engine bench "${common[@]}" "${multiturn[@]}" --backend file \
    --config "{\"root\": \"$l3/multiturn\"}" --json "$out/multiturn-file.json" \
    $(plot multiturn-file)
fi
if want documents; then
  hicache engine bench "${common[@]}" "${documents[@]}" --backend file \
    --config "{\"root\": \"$l3/documents\"}" --json "$out/documents-file.json" \
    $(plot documents-file)
fi
want mooncake || exit 0

mc=$(python3 -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')
"$mc/mooncake_master" -rpc_address=127.0.0.1 -rpc_port=50151 -metrics_host=127.0.0.1 \
  -metrics_port=19003 -logtostderr=false >"$l3/mooncake_master.log" 2>&1 &
pids+=($!)
sleep 2
"$mc/mooncake_client" -host=127.0.0.1 -metadata_server=P2PHANDSHAKE \
  -master_server_address=127.0.0.1:50151 -global_segment_size=24GB -port=50152 \
  -protocol=tcp >"$l3/mooncake_client.log" 2>&1 &
pids+=($!)
sleep 3
GLOG_minloglevel=2 hicache engine bench "${common[@]}" "${multiturn[@]}" --backend mooncake \
  --config '{"master": "127.0.0.1:50151", "protocol": "tcp"}' --runs L1+L2+L3 \
  --json "$out/multiturn-mooncake.json" $(plot multiturn-mooncake)
