"""Where a small forward's time goes on a GPU: launching its kernels or running them.

Times the engine model's forwards of the shapes a storage-served request meets (a 64-token
prefill over an 8,256-token context, four decodes over such contexts, both in one batch, and a
64-token prefill with no context), each with and without the CUDA graphs of
``LlamaModel(graphs=...)``, and profiles one of each: wall time (median of 10), the time the CPU
took to issue it (no synchronisation), the kernels' own time and the number of launches. A
forward whose issue time exceeds its kernels' time is bound by its launches.

    python scripts/profile_forward.py [--model 8b|70b-layers] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from hicache_storage.bench.engine import BenchConfig
from hicache_storage.engine import LlamaModel
from hicache_storage.engine.model import Segment
from hicache_storage.kernels import DevicePool

CONTEXT = 8256
"""The overflow workload's later queries: an 8,192-token document and a 64-token question."""


def main() -> None:
    """Print the table for the model and device asked for."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="8b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    shape = BenchConfig(model=args.model, device=args.device).model_config()
    pool = DevicePool.mha(
        4 * (CONTEXT + 64), shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, args.device
    )
    device = torch.device(args.device)

    def segment(i: int, new: int, context: int = CONTEXT) -> Segment:
        first = i * (CONTEXT + 64)
        slots = torch.arange(first, first + context, device=device)
        return Segment(torch.randint(0, 100, (new,), device=device), slots)

    cases: dict[str, Callable[[], list[Segment]]] = {
        "prefill 64 over 8k": lambda: [segment(0, 64)],
        "4 decodes over 8k": lambda: [segment(i, 1) for i in range(4)],
        "3 decodes + prefill 64": lambda: [*(segment(i, 1) for i in range(1, 4)), segment(0, 64)],
        "prefill 64, no context": lambda: [segment(0, 64, 64)],
    }
    print(f"{'forward':26s} {'graphs':>6s} {'wall ms':>8s} {'issue ms':>9s} {'kernels ms':>11s}"
          f" {'launches':>9s}")  # fmt: skip
    for graphs in (False, True):
        model = LlamaModel(shape, device, graphs=graphs)
        for name, make in cases.items():
            print(f"{name:26s} {graphs!s:>6s} {_measure(model, pool, make(), device)}")


def _measure(
    model: LlamaModel, pool: DevicePool, segments: list[Segment], device: torch.device
) -> str:
    def run() -> None:
        model.forward(segments, pool)

    def sync() -> None:
        if device.type == "cuda":
            sync()

    for _ in range(3):
        run()
        sync()
    times = []
    for _ in range(10):
        began = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - began)
    began = time.perf_counter()
    run()
    issued = time.perf_counter() - began
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    # A graph replay is one cudaGraphLaunch; the kernels inside it are not counted.
    return (
        f"{statistics.median(times) * 1e3:8.1f} {issued * 1e3:9.1f} {kernels:11.1f} {launches:9d}"
    )


if __name__ == "__main__":
    main()
