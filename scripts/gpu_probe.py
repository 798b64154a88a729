"""Measurements behind the GPU notes of docs/performance.md that the kernel bench does not make.

    python scripts/gpu_probe.py [round-trip] [in-flight] [both] [launches]

* ``round-trip``: the PCIe read round trip seen by one GPU thread (a pointer chase through pinned
  host memory, one 128-byte line per hop, never the same line twice): over buffers of growing
  size, and while other copies run.
* ``in-flight``: H2D kernel GB/s on 1 to 16 SMs, and one-layer copies of scattered rows by SMs.
* ``both``: D2H and H2D at once, over D2H paces and H2D SM budgets, and with a copy engine doing
  one direction.
* ``launches``: one-layer launches of 64 to 4096 tokens: time per launch beyond a copy-engine
  copy of the same bytes, with and without programmatic dependent launch and re-tiling.

Needs a CUDA GPU (Hopper or later for the launch comparison) and the package installed.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hicache_storage.bench.kernels import SHAPES, Bench, parse_args, two_streams
from hicache_storage.kernels import KernelConfig, KVTransfer

HOPS = 2000


@triton.jit
def _nanoseconds():  # type: ignore[no-untyped-def]
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _chase(host_ptr, state_ptr, hops):  # type: ignore[no-untyped-def]
    """Follow ``hops`` links from state[1]; leave the nanoseconds in state[0], the end in [1]."""
    at = tl.load(state_ptr + 1)
    start = _nanoseconds()
    for _ in range(hops):
        at = tl.load(host_ptr + at, volatile=True)
    tl.store(state_ptr, _nanoseconds() - start)
    tl.store(state_ptr + 1, at)


class Chase:
    """A random cycle through every 128-byte line of a pinned buffer of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes // 8, dtype=torch.int64, pin_memory=True)
        order = torch.randperm(nbytes // 128) * 16
        self.host[order] = torch.roll(order, -1)
        self.state = torch.tensor([0, int(order[0])], dtype=torch.int64, device="cuda")

    def once(self) -> None:
        """Launch one chase of HOPS links on the current stream."""
        _chase[(1,)](self.host, self.state, HOPS, num_warps=1)

    def microseconds(self) -> float:
        """Median round trip of five chases, each going on where the last one stopped."""
        self.once()
        times = []
        for _ in range(5):
            self.once()
            torch.cuda.synchronize()
            times.append(int(self.state[0]) / HOPS / 1e3)
        return statistics.median(times)


def _bench(shape: str, page_size: int, pages: int) -> Bench:
    return Bench(parse_args(["--pages", str(pages), "--samples", "3"]), SHAPES[shape], page_size)


def round_trip() -> None:
    """Print the read round trip over growing buffers, then beside each kind of traffic."""
    for mib in (8, 32, 128, 512, 2048, 8192):
        print(f"round trip, lines spread over {mib} MiB: {Chase(mib << 20).microseconds():.2f} µs")
    chase = Chase(512 << 20)
    bench = _bench("8b", 64, 256)
    pool = bench.host_pool("layer_first")
    out_dev, out_host = bench.indices(256)
    in_dev, in_host = bench.indices(256, second=True)
    nbytes = 256 * 64 * bench.shape.token_nbytes(2)
    on8 = KVTransfer(bench.device, pool, sm_budget=8)
    on2 = KVTransfer(bench.device, pool, sm_budget=2)
    pinned, staging = bench.pinned[:nbytes], bench.staging[:nbytes]
    traffic: dict[str, Callable[[], object]] = {
        "nothing": lambda: None,
        "kernel D2H, 8 SMs": lambda: on8.backup(out_dev, out_host),
        "kernel D2H, 8 SMs paced to 44 GB/s": lambda: on8.backup(out_dev, out_host, max_gbps=44),
        "kernel D2H, 2 SMs": lambda: on2.backup(out_dev, out_host),
        "copy-engine D2H": lambda: pinned.copy_(staging, non_blocking=True),
        "kernel H2D, 8 SMs": lambda: on8.load(in_host, in_dev),
        "copy-engine H2D": lambda: staging.copy_(pinned, non_blocking=True),
    }
    side, main = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for name, work in traffic.items():
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                for _ in range(40):  # tens of milliseconds of traffic
                    work()
            with torch.cuda.stream(main):
                torch.cuda._sleep(2_000_000)  # let the traffic start first
                chase.once()
            torch.cuda.synchronize()
            times.append(int(chase.state[0]) / HOPS / 1e3)
        print(f"round trip over 512 MiB while {name}: {statistics.median(times):.2f} µs")


def in_flight() -> None:
    """Print H2D GB/s by SM count, and one-layer copies of scattered rows by SM count."""
    bench = _bench("8b", 64, 256)
    pool = bench.host_pool("layer_first")
    dev_idx, host_idx = bench.indices(256)
    nbytes = 256 * 64 * bench.shape.token_nbytes(2)
    transfer = KVTransfer(bench.device, pool)
    for sms in (1, 2, 4, 8, 16):
        transfer.sm_budget = sms
        seconds = bench.kernel(transfer, dev_idx, host_idx, False, False)
        print(f"8B H2D, all layers, 256 pages of 64, {sms} SMs: {nbytes / seconds / 1e9:.1f} GB/s")
    del bench, pool, transfer
    bench = _bench("mla", 1, 16384)
    dev_idx, host_idx = bench.indices(16384)
    nbytes = 16384 * bench.shape.token_nbytes(2)
    for layout in ("page_first", "layer_first"):
        pool = bench.host_pool(layout)
        transfer = KVTransfer(bench.device, pool)
        for to_host in (False, True):
            rates = []
            for budget in (4, 8, 16, 32, None):
                transfer.sm_budget = budget
                seconds = bench.kernel(transfer, dev_idx, host_idx, to_host, True)
                rates.append(f"{budget or 'all'}: {nbytes / seconds / 1e9:.1f}")
            way = "D2H" if to_host else "H2D"
            print(
                f"MLA one layer per launch, 16384 one-token pages, {layout} {way} GB/s by SMs: "
                + ", ".join(rates)
            )


def both() -> None:
    """Print D2H and H2D at once, per shape, against two copy engines."""
    for shape in ("8b", "mla", "70b-tp8"):
        _both(_bench(shape, 64, 256))
        torch.cuda.empty_cache()


def _both(bench: Bench) -> None:
    pool = bench.host_pool("layer_first")
    out_dev, out_host = bench.indices(256)
    in_dev, in_host = bench.indices(256, second=True)
    nbytes = 256 * 64 * bench.shape.token_nbytes(2)
    pinned, staging = bench.pinned[:nbytes], bench.staging[:nbytes]
    pinned2, staging2 = bench.second_pinned[:nbytes], bench.second_staging[:nbytes]
    ce_d2h = functools.partial(pinned.copy_, staging, non_blocking=True)
    ce_h2d = functools.partial(staging2.copy_, pinned2, non_blocking=True)
    ceiling = 2 * nbytes / two_streams(ce_d2h, ce_h2d, 3)[2] / 1e9
    print(f"{bench.shape.name}: two copy engines {ceiling:.1f} GB/s")

    def show(name: str, d2h: Callable[[], object], h2d: Callable[[], object]) -> None:
        d2h_s, h2d_s, both_s = two_streams(d2h, h2d, 3)
        total = 2 * nbytes / both_s / 1e9
        print(
            f"  {name}: {total:.1f} GB/s = {100 * total / ceiling:.0f} % "
            f"(D2H {nbytes / d2h_s / 1e9:.1f}, H2D {nbytes / h2d_s / 1e9:.1f})"
        )

    backup = KVTransfer(bench.device, pool, sm_budget=8)
    kernel_d2h = functools.partial(backup.backup, out_dev, out_host)
    show(
        "copy-engine D2H + kernel H2D (8 SMs)",
        ce_d2h,
        functools.partial(KVTransfer(bench.device, pool, sm_budget=8).load, in_host, in_dev),
    )
    show("kernel D2H (8 SMs) + copy-engine H2D", kernel_d2h, ce_h2d)
    loads = {
        sms: functools.partial(KVTransfer(bench.device, pool, sm_budget=sms).load, in_host, in_dev)
        for sms in (8, 12, 16, 24)
    }
    for sms, load in loads.items():
        for cap in (None, 46, 44, 42, 40):
            pace = "unpaced" if cap is None else f"paced to {cap} GB/s"
            show(
                f"kernel D2H (8 SMs, {pace}) + kernel H2D ({sms} SMs)",
                functools.partial(kernel_d2h, max_gbps=cap),
                load,
            )
    # Smaller bursts of paced writes: fewer D2H SMs, or smaller D2H tiles.
    for d2h_sms, tile in ((4, 32768), (8, 8192)):
        small = KVTransfer(
            bench.device, pool, sm_budget=d2h_sms, config=KernelConfig(tile_bytes=tile)
        )
        for sms in (8, 12):
            show(
                f"kernel D2H ({d2h_sms} SMs, {tile // 1024} KiB tiles, paced to 42 GB/s) "
                f"+ kernel H2D ({sms} SMs)",
                functools.partial(small.backup, out_dev, out_host, max_gbps=42),
                loads[sms],
            )


def launches() -> None:
    """Print per-launch cost beyond the copy engine, with and without PDL and re-tiling."""
    variants = {
        "default": KernelConfig(),
        "no PDL": KernelConfig(pdl=False),
        "no re-tiling": KernelConfig(balance_rounds=0),
    }
    for shape in ("70b-tp8", "mla", "8b"):
        bench = _bench(shape, 1, 4096)
        layers = bench.device.layer_num
        pool = bench.host_pool("layer_first")
        transfers = {
            name: KVTransfer(bench.device, pool, sm_budget=8, config=config)
            for name, config in variants.items()
        }
        for to_host in (False, True):
            for tokens in (64, 256, 1024, 4096):
                dev_idx, host_idx = bench.indices(tokens)
                nbytes = tokens * bench.shape.token_nbytes(2)
                contig = bench.contiguous(nbytes, to_host, layers)
                parts = []
                for name, transfer in transfers.items():
                    seconds = bench.kernel(transfer, dev_idx, host_idx, to_host, True)
                    extra = (seconds - contig) / layers * 1e6
                    parts.append(f"{name} {100 * contig / seconds:.0f} % ({extra:+.2f} µs)")
                print(
                    f"{shape} layer_first {'D2H' if to_host else 'H2D'}, one layer of "
                    f"{nbytes / layers / 1024:.0f} KiB per launch, 8 SMs, vs copy engine "
                    f"({nbytes / contig / 1e9:.1f} GB/s): " + "; ".join(parts)
                )
        del bench, pool, transfers
        torch.cuda.empty_cache()


PROBES: dict[str, Callable[[], None]] = {
    "round-trip": round_trip,
    "in-flight": in_flight,
    "both": both,
    "launches": launches,
}


def main(argv: list[str]) -> int:
    """Run the named probes (all when none is named); return a process exit code."""
    if not torch.cuda.is_available():
        print("gpu_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    for name in argv or list(PROBES):
        print(f"## {name}", flush=True)
        PROBES[name]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
