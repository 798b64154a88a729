"""What the vLLM tier costs and buys, on real vLLM (run with .venv-vllm/bin/python).

1. Cost per chunk: the tier's store and load jobs (``submit_store``/``submit_load`` until
   ``get_finished_jobs`` reports them) beside the same backend's ``batch_set_v1``/``batch_get_v1``
   called directly on the same chunks of vLLM's primary tier, one call per job either way; the
   tier with one read and one write thread so that only its own work differs. Runs of either
   kind vary by about 10 % on a 2-core machine, so the tier's own cost is also measured
   directly: its time outside the backend call it makes (``overhead``).
2. TTFT of a fresh engine whose prompt extends a stored prefix, beside a fresh engine that
   computes the whole prompt.

Prints a table and writes JSON (``--out``). Usage::

    .venv-vllm/bin/python scripts/bench_vllm.py --out docs/data/vllm-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache_storage.integrations.vllm import harness

ROOT = Path(tempfile.mkdtemp(prefix="hicache-vllm-bench-"))
os.environ.update(harness.cpu_environment(ROOT, kv_cache_gib=2))


def cost_per_chunk(model: Path, jobs: int, chunks: int, repeats: int) -> dict[str, Any]:
    """Median seconds per chunk of tier jobs and of direct backend calls, stores and loads."""
    import numpy as np
    import torch
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    tier_entry = {
        "backend": "file",
        "options": {"root": str(ROOT / "cost-store")},
        "read_threads": 1,
        "write_threads": 1,
    }
    config = harness.kv_transfer_config(tier_entry, cpu_bytes=(jobs * chunks + 64) * 64 * 1024)
    sides = ("tier", "direct", "in_backend")
    results: dict[str, list[float]] = {f"{s}_{op}": [] for s in sides for op in ("store", "load")}
    with harness.engine(model, config) as llm:
        (tier,) = harness.tiers(llm)
        backend = tier.backend
        rows = np.arange(jobs * chunks).reshape(jobs, chunks)
        torch.manual_seed(0)
        tier._pool.kv_buffer.view(-1)[: rows.size * tier.block_size_bytes].random_(0, 255)
        context = ReqContext(req_id="bench")
        job_id = 1_000_000

        inside = [0.0]

        def timed(call: Any) -> Any:
            def run(*args: Any) -> Any:
                start = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    inside[0] += time.perf_counter() - start

            return run

        def run_tier(load: bool, tag: str) -> float:
            nonlocal job_id
            name = "batch_get_v1" if load else "batch_set_v1"
            setattr(backend, name, timed(getattr(type(backend), name).__get__(backend)))
            inside[0] = 0.0
            start = time.perf_counter()
            for j in range(jobs):
                keys = [f"{tag}{j:04d}{c:04d}".encode().ljust(36, b"\0") for c in range(chunks)]
                job = TransferJob(job_id, keys, rows[j], is_promotion=load, req_context=context)
                job_id += 1
                (tier.submit_load if load else tier.submit_store)(job)
            tier.drain_jobs()
            finished = list(tier.get_finished_jobs())
            elapsed = time.perf_counter() - start
            delattr(backend, name)
            assert len(finished) == jobs and all(r.success for r in finished), finished
            results[f"in_backend_{'load' if load else 'store'}"].append(inside[0] / (jobs * chunks))
            return elapsed / (jobs * chunks)

        def run_direct(load: bool, tag: str) -> float:
            start = time.perf_counter()
            for j in range(jobs):
                keys = [f"direct-{tag}-{j:04d}-{c:04d}" for c in range(chunks)]
                call = backend.batch_get_v1 if load else backend.batch_set_v1
                assert all(call(keys, torch.from_numpy(rows[j])))
            return (time.perf_counter() - start) / (jobs * chunks)

        for r in range(repeats):
            tag = f"r{r}"
            # Alternate the order so neither side always runs on a warmer page cache.
            for side in ("tier", "direct") if r % 2 == 0 else ("direct", "tier"):
                run = run_tier if side == "tier" else run_direct
                results[f"{side}_store"].append(run(False, tag))
                results[f"{side}_load"].append(run(True, tag))
    medians = {name: statistics.median(values) for name, values in results.items()}
    return {
        "jobs": jobs,
        "chunks_per_job": chunks,
        "chunk_bytes": 64 * 1024,
        "repeats": repeats,
        "median_s_per_chunk": medians,
        "all_s_per_chunk": results,
        "store_ratio": medians["tier_store"] / medians["direct_store"],
        "load_ratio": medians["tier_load"] / medians["direct_load"],
        "store_overhead": medians["tier_store"] / medians["in_backend_store"] - 1,
        "load_overhead": medians["tier_load"] / medians["in_backend_load"] - 1,
    }


def ttft(model: Path, prefix: int, suffix: int, repeats: int) -> dict[str, Any]:
    """Seconds to the first token of one request on a fresh engine: stored prefix vs recompute."""
    prompts = harness.prompts(repeats + 1, prefix, suffix, seed=11)
    tier = {"backend": "file", "options": {"root": str(ROOT / "ttft-store")}}
    config = harness.kv_transfer_config(tier, cpu_bytes=(prefix // 32 + 64) * 64 * 1024)
    with harness.engine(model, config, max_model_len=prefix + suffix + 64) as llm:
        harness.generate(llm, prompts[:1], max_tokens=1)  # stores the prefix
    timings: dict[str, list[float]] = {"recompute": [], "stored_prefix": []}
    cached: list[int] = []
    for prompt in prompts[1:]:
        for name, kv in (("recompute", None), ("stored_prefix", config)):
            with harness.engine(model, kv, max_model_len=prefix + suffix + 64) as llm:
                harness.generate(llm, [harness.prompts(1, 64, 0, seed=99)[0]], max_tokens=1)
                start = time.perf_counter()
                (gen,) = harness.generate(llm, [prompt], max_tokens=1)
                timings[name].append(time.perf_counter() - start)
                if kv is not None:
                    cached.append(gen.cached_tokens)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    return {
        "prefix_tokens": prefix,
        "suffix_tokens": suffix,
        "repeats": repeats,
        "cached_tokens": cached,
        "median_s": medians,
        "all_s": timings,
        "ratio": medians["stored_prefix"] / medians["recompute"],
    }


def main() -> None:
    """Run both measurements; print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = harness.write_tiny_model(
        ROOT / "model", config={"max_position_embeddings": args.prefix + args.suffix + 64}
    )
    cost = cost_per_chunk(model, args.jobs, args.chunks, args.repeats)
    first = ttft(model, args.prefix, args.suffix, args.repeats)
    med = cost["median_s_per_chunk"]
    print(
        f"{'chunk cost (64 KiB, file)':<34}{'tier us':>10}{'direct us':>11}{'ratio':>8}"
        f"{'overhead':>10}"
    )
    for op in ("store", "load"):
        tier_us, direct_us = med[f"tier_{op}"] * 1e6, med[f"direct_{op}"] * 1e6
        print(
            f"{op:<34}{tier_us:>10.1f}{direct_us:>11.1f}{tier_us / direct_us:>8.3f}"
            f"{cost[f'{op}_overhead']:>10.1%}"
        )
    print(f"{'TTFT, fresh engine':<34}{'stored ms':>10}{'recompute':>11}{'ratio':>8}")
    ms = first["median_s"]
    label = f"{args.prefix}-token prefix + {args.suffix}"
    print(
        f"{label:<34}{ms['stored_prefix'] * 1e3:>10.1f}{ms['recompute'] * 1e3:>11.1f}"
        f"{first['ratio']:>8.3f}   cached tokens {first['cached_tokens']}"
    )
    if args.out:
        args.out.write_text(json.dumps({"cost_per_chunk": cost, "ttft": first}, indent=1))


if __name__ == "__main__":
    main()
