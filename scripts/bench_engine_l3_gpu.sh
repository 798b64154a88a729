#!/usr/bin/env bash
# Where the storage tier has to serve, on a GPU: the figures of docs/performance.md
# ("The storage tier on an H200").
#
#   bash scripts/bench_engine_l3_gpu.sh OUTDIR [STEP...]
#
# Steps (default all), each one `hicache engine bench` written to OUTDIR/STEP.json:
#   overflow          24 documents x 8,192 tokens, 3 queries each; the KV is 2.4x the host pool
#   overflow-timeout  the same under SGLang's `timeout` prefetch (L1+L2+L3 only)
#   overflow-3fs      the same with L3 = the 3fs backend on local disk (L1+L2+L3 only)
#   notax             24 clients x 6 rounds whose histories the 8 GiB host pool holds
#   notax-timeout     the same under `timeout` (L1+L2+L3 only)
#   multiturn         12 clients x 5 rounds of 1-2k-token turns
#   outgrow           16 clients x 6 rounds whose histories outgrow the host pool
#   outgrow-long      8 clients x 10 rounds: histories of up to 20k tokens, 3x device and host
#   overflow-70b      16 documents x 3 queries on 20 layers of the Llama-3-70B shape
#   overflow-chain    overflow with L3 = a chain: a file tier bounded at a quarter of the KV (6 GiB)
#                     in front of the file backend on another directory (write-through)
#   overflow-chain-behind  the same chain writing its second tier behind the first
#   overflow-chain-one     a chain of that second tier alone: what the chain's own calls cost
# Needs the package installed and one CUDA GPU; the stores live under a temporary directory
# removed after each step (the GPU host's disk holds 64 GiB); each step starts after a `sync`, so
# no step's writes are throttled by an earlier step's dirty pages. BENCH_ARGS (e.g. "--repeat 3"
# or "--runs L1+L2,L1+L2+L3") is added to every step's command. L3_PROCESS=1 serves each step's
# file backend from a storage process of its own (the `process` backend over a shared host pool),
# serving L3_PROCESS_THREADS calls at once (default 8).
set -euo pipefail
out=${1:?usage: bench_engine_l3_gpu.sh OUTDIR [STEP...]}
shift
steps=${*:-overflow overflow-timeout overflow-3fs notax notax-timeout multiturn outgrow outgrow-long overflow-70b}
mkdir -p "$out"
l3=$(mktemp -d /tmp/hicache-l3.XXXX)
trap 'rm -rf "$l3"' EXIT

common=(--device cuda --set page_size=64 --set engine.chunk_tokens=8192 --set workload.max_new_tokens=4
        --set workload.concurrency=4 --set engine.host_layout=page_first --set write.policy=write_through)
documents=(--workload documents --rounds 3 --set workload.document_tokens=8192
           --set workload.question_tokens=64 --set engine.device_tokens=36864)
file() { echo "{\"root\": \"$l3/$1\"}"; }
chain() {  # $1: the step, $2: the chain's write policy; the near tier holds a quarter of the KV,
  # evicting behind its writes from 0.95 (half the headroom above the 0.9 low watermark)
  echo "{\"write_policy\": \"$2\", \"tiers\": [{\"backend\": \"file\", \"options\": {\"root\":" \
    "\"$l3/$1/near\", \"max_bytes\": 6442450944, \"high_watermark\": 0.95}}," \
    "{\"backend\": \"file\", \"options\": {\"root\": \"$l3/$1/far\"}}]}"
}
threefs() {  # 8 MiB slots: one page of the 8B shape (64 tokens x 128 KiB); 16 files: writes to one file are serialised
  echo "{\"path\": \"$l3/$1\", \"slot_bytes\": 8388608, \"file_size\": 2147483648, \"file_count\": 16}"
}

bench() {
  local step=$1
  shift
  if [[ ${L3_PROCESS:-0} == 1 ]]; then
    local args=() backend=""
    while (($#)); do
      case $1 in
        --backend) backend=$2; args+=(--backend process); shift 2 ;;
        --config) args+=(--config "{\"backend\": \"$backend\", \"threads\": ${L3_PROCESS_THREADS:-8}, \"options\": $2}"); shift 2 ;;
        *) args+=("$1"); shift ;;
      esac
    done
    set -- "${args[@]}"
  fi
  echo "== $step: hicache engine bench $*"
  sync
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  hicache engine bench "$@" ${BENCH_ARGS:-} --json "$out/$step.json"
  rm -rf "${l3:?}"/*
}

for step in $steps; do
  case $step in
    overflow)
      bench "$step" --model 8b "${common[@]}" "${documents[@]}" --clients 24 \
        --set engine.host_tokens=81920 --backend file --config "$(file "$step")" ;;
    overflow-timeout)
      bench "$step" --model 8b "${common[@]}" "${documents[@]}" --clients 24 \
        --set engine.host_tokens=81920 --backend file --config "$(file "$step")" \
        --set prefetch.policy=timeout --runs L1+L2+L3 ;;
    overflow-3fs)
      bench "$step" --model 8b "${common[@]}" "${documents[@]}" --clients 24 \
        --set engine.host_tokens=81920 --backend 3fs --config "$(threefs "$step")" --runs L1+L2+L3 ;;
    notax)
      bench "$step" --model 8b "${common[@]}" --workload multiturn --clients 24 --rounds 6 \
        --set workload.system_tokens=256 --set 'workload.turn_tokens=[256,512]' \
        --set engine.device_tokens=16384 --set engine.host_tokens=65536 \
        --backend file --config "$(file "$step")" ;;
    notax-timeout)
      bench "$step" --model 8b "${common[@]}" --workload multiturn --clients 24 --rounds 6 \
        --set workload.system_tokens=256 --set 'workload.turn_tokens=[256,512]' \
        --set engine.device_tokens=16384 --set engine.host_tokens=65536 \
        --backend file --config "$(file "$step")" --set prefetch.policy=timeout --runs L1+L2+L3 ;;
    multiturn)
      bench "$step" --model 8b "${common[@]}" --workload multiturn --clients 12 --rounds 5 \
        --set workload.system_tokens=256 --set 'workload.turn_tokens=[1024,2048]' \
        --set engine.device_tokens=40960 --set engine.host_tokens=65536 \
        --backend file --config "$(file "$step")" ;;
    outgrow)
      bench "$step" --model 8b "${common[@]}" --workload multiturn --clients 16 --rounds 6 \
        --set workload.system_tokens=256 --set 'workload.turn_tokens=[1024,2048]' \
        --set engine.device_tokens=40960 --set engine.host_tokens=32768 \
        --backend file --config "$(file "$step")" ;;
    outgrow-long)
      bench "$step" --model 8b "${common[@]}" --workload multiturn --clients 8 --rounds 10 \
        --set workload.system_tokens=256 --set 'workload.turn_tokens=[1024,2048]' \
        --set engine.device_tokens=40960 --set engine.host_tokens=32768 \
        --backend file --config "$(file "$step")" ;;
    overflow-70b)
      bench "$step" --model 70b-layers "${common[@]}" "${documents[@]}" --clients 16 \
        --set engine.host_tokens=40960 --backend file --config "$(file "$step")" ;;
    overflow-chain | overflow-chain-behind | overflow-chain-one)
      chain_writes=through
      [[ $step == overflow-chain-behind ]] && chain_writes=behind
      config=$(chain "$step" "$chain_writes")
      [[ $step == overflow-chain-one ]] && config="{\"tiers\": [{\"backend\": \"file\", \"options\": $(file "$step")}]}"
      bench "$step" --model 8b "${common[@]}" "${documents[@]}" --clients 24 \
        --set engine.host_tokens=81920 --backend chain --config "$config" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
