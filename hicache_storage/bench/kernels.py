"""Benchmark the transfer kernel against copy-engine yardsticks on one GPU.

``hicache kernels bench`` (or ``python -m hicache_storage.bench.kernels``) times, for each
model shape, page size, page count, host layout, direction and mode (one launch per layer, or
all layers in one launch), the kernel under SM budgets of 4, 8 and unlimited, beside three
yardsticks measured in the same run:

* ``contig``: one contiguous pinned copy of the same byte count (per layer: one per layer), the
  ceiling the kernel is judged against;
* ``loop``: one ``copy_`` per (page, layer, K/V), the naive way;
* ``gather``: a GPU gather into a staging tensor plus one bulk copy (host-side scatter not counted).

Then H2D and D2H kernels at once on two streams, against two contiguous copies on two streams.
Kernel and yardstick times are CUDA-event medians of CUDA-graph replays (``--eager`` times plain
calls instead); the ``loop`` yardstick is always timed eagerly, as it runs. Prints a table and
writes every number to a JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeAlias

import torch

from hicache_storage.hostpool import Layout, MHAHostPool, MLAHostPool
from hicache_storage.kernels.dispatch import KVTransfer
from hicache_storage.kernels.pools import DevicePool, HostView

__all__ = ["SHAPES", "Bench", "Case", "Shape", "main", "parse_args", "two_streams"]


@dataclass(frozen=True)
class Shape:
    """A model's KV geometry on one rank."""

    name: str
    layers: int
    heads: int
    head_dim: int
    mla: bool = False

    @property
    def kv(self) -> int:
        """K and V tensors per layer (1 for MLA)."""
        return 1 if self.mla else 2

    def token_nbytes(self, element: int) -> int:
        """Bytes of one token over every layer, K and V."""
        return self.kv * self.layers * self.heads * self.head_dim * element


SHAPES = {
    "8b": Shape("llama3-8b", 32, 8, 128),
    "70b-tp8": Shape("70b-tp8", 80, 1, 128),
    "mla": Shape("mla-576", 61, 1, 576, mla=True),
}

BUDGETS: tuple[int | None, ...] = (4, 8, None)
Row: TypeAlias = dict[str, float | int | str]


@dataclass
class Case:
    """One measured row of the table: GB/s of each way to move the same bytes."""

    shape: str
    page_size: int
    pages: int
    layout: str
    direction: str
    mode: str
    nbytes: int
    contig: float
    loop: float | None
    gather: float
    kernel: dict[str, float] = field(default_factory=dict)


def _event() -> torch.cuda.Event:
    """Make a timing CUDA event (torch leaves its constructor untyped)."""
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _stream() -> torch.cuda.Stream:
    """Make a CUDA stream (torch leaves its constructor untyped)."""
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def _median_seconds(run: Callable[[], None], target_s: float, samples: int) -> float:
    """Median seconds of one ``run``, timed with CUDA events over batches of about target_s."""
    run()
    torch.cuda.synchronize()
    start, end = _event(), _event()
    start.record()
    run()
    end.record()
    end.synchronize()
    once = max(float(start.elapsed_time(end)) / 1e3, 1e-7)
    batch = max(1, min(1000, math.ceil(target_s / once)))
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(batch):
            run()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3 / batch)
    return statistics.median(times)


class Timer:
    """Times callables as CUDA-graph replays (or eagerly) with CUDA-event medians."""

    def __init__(self, *, eager: bool, target_s: float, samples: int) -> None:
        self.eager = eager
        self.target_s = target_s
        self.samples = samples
        self._pool = torch.cuda.graph_pool_handle()

    def seconds(self, work: Callable[[], None], *, eager: bool = False) -> float:
        """Median seconds of one call of ``work``."""
        if self.eager or eager:
            return _median_seconds(work, self.target_s, self.samples)
        stream = _stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            work()  # warm up (compiles the kernel) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            work()
        seconds = _median_seconds(graph.replay, self.target_s, self.samples)
        del graph
        return seconds


def _fill_random(tensor: torch.Tensor, device: torch.device) -> None:
    """Fill ``tensor`` (any dtype, any device) with random bytes, in chunks generated on the GPU."""
    flat = tensor.view(-1).view(torch.uint8)
    step = 1 << 28
    for begin in range(0, flat.numel(), step):
        part = flat[begin : begin + step]
        part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=device))


def _page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    offsets = torch.arange(page_size)
    return (pages[:, None] * page_size + offsets).reshape(-1)


class Bench:
    """Holds the buffers of one shape and page size and measures every case over them."""

    def __init__(self, args: argparse.Namespace, shape: Shape, page_size: int) -> None:
        self.args = args
        self.shape = shape
        self.page_size = page_size
        self.gpu = torch.device("cuda")
        self.timer = Timer(eager=args.eager, target_s=args.target_ms / 1e3, samples=args.samples)
        max_pages = max(args.pages)
        # Spare pages so the two directions of the concurrent run use disjoint slots.
        self.pool_pages = 2 * max_pages + 8
        self.size = self.pool_pages * page_size
        if shape.mla:
            self.device = DevicePool.mla(self.size, shape.layers, shape.head_dim, device=self.gpu)
        else:
            self.device = DevicePool.mha(
                self.size, shape.layers, shape.heads, shape.head_dim, device=self.gpu
            )
        for part in self.device.buffers:
            for tensor in part:
                _fill_random(tensor, self.gpu)
        element = self.device.dtype.itemsize
        most = max_pages * page_size * shape.token_nbytes(element)
        self.pinned = torch.empty(most, dtype=torch.uint8, pin_memory=True)
        self.staging = torch.empty(most, dtype=torch.uint8, device=self.gpu)
        self.second_pinned = torch.empty(most, dtype=torch.uint8, pin_memory=True)
        self.second_staging = torch.empty(most, dtype=torch.uint8, device=self.gpu)
        generator = torch.Generator().manual_seed(page_size)
        self.device_pages = torch.randperm(self.pool_pages, generator=generator)
        self.host_pages = torch.randperm(self.pool_pages, generator=generator)
        self.yardsticks: dict[tuple[int, str, bool], tuple[float, float]] = {}

    def host_pool(self, layout: str) -> MHAHostPool | MLAHostPool:
        """Allocate a pinned host pool of ``layout`` filled with random bytes."""
        shape = self.shape
        pool: MHAHostPool | MLAHostPool
        if shape.mla:
            pool = MLAHostPool(
                self.size, self.page_size, shape.layers, shape.head_dim, layout=layout
            )
        else:
            pool = MHAHostPool(
                self.size, self.page_size, shape.layers, shape.heads, shape.head_dim, layout=layout
            )
        _fill_random(pool.kv_buffer, self.gpu)
        return pool

    def indices(self, pages: int, second: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Device and host slots of ``pages`` random, unsorted pages (the second set disjoint)."""
        begin = self.pool_pages // 2 if second else 0
        dev = _page_slots(self.device_pages[begin : begin + pages], self.page_size)
        host = _page_slots(self.host_pages[begin : begin + pages], self.page_size)
        return dev.to(self.gpu), host.to(self.gpu)

    # -- yardsticks ---------------------------------------------------------------------------

    def contiguous(self, nbytes: int, to_host: bool, copies: int) -> float:
        """Seconds of ``copies`` contiguous pinned copies of ``nbytes / copies`` each."""
        each = nbytes // copies
        pinned, staging = self.pinned[:each], self.staging[:each]

        def work() -> None:
            for _ in range(copies):
                if to_host:
                    pinned.copy_(staging, non_blocking=True)
                else:
                    staging.copy_(pinned, non_blocking=True)

        return self.timer.seconds(work)

    def page_loop(
        self, host: HostView, dev_pages: torch.Tensor, host_pages: torch.Tensor, to_host: bool
    ) -> float:
        """Seconds of one ``copy_`` per (page, layer, K/V), timed eagerly once."""
        rows = host.rows()
        size = self.page_size
        pairs = list(zip(dev_pages.tolist(), host_pages.tolist(), strict=True))

        def work() -> None:
            for kv in range(self.device.num_kv):
                for layer in range(self.device.layer_num):
                    dev_rows = self.device.rows(kv, layer).view(-1, host.head_num, host.head_elems)
                    host_rows = rows[kv, layer]
                    for dev_page, host_page in pairs:
                        dev_part = dev_rows[dev_page * size : (dev_page + 1) * size]
                        if to_host:
                            host_rows[host_page].copy_(dev_part, non_blocking=True)
                        else:
                            dev_part.copy_(host_rows[host_page], non_blocking=True)

        torch.cuda.synchronize()
        start, end = _event(), _event()
        start.record()
        work()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def gather_bulk(self, dev_idx: torch.Tensor, to_host: bool, per_layer: bool) -> float:
        """Seconds of a GPU gather into staging plus one bulk copy (per layer, or for all)."""
        device = self.device
        row = math.prod(device.row_shape)
        tokens = int(dev_idx.numel())
        layer_bytes = tokens * device.num_kv * row * device.dtype.itemsize
        groups = (
            [[layer] for layer in range(device.layer_num)]
            if per_layer
            else [list(range(device.layer_num))]
        )

        def one(group: Sequence[int]) -> None:
            count = len(group) * layer_bytes
            flat = self.staging[:count]
            staging = flat.view(device.dtype).view(len(group), device.num_kv, tokens, row)
            pinned = self.pinned[:count]
            if not to_host:
                flat.copy_(pinned, non_blocking=True)
            for i, layer in enumerate(group):
                for kv in range(device.num_kv):
                    if to_host:
                        torch.index_select(device.rows(kv, layer), 0, dev_idx, out=staging[i, kv])
                    else:
                        device.rows(kv, layer).index_copy_(0, dev_idx, staging[i, kv])
            if to_host:
                pinned.copy_(flat, non_blocking=True)

        def work() -> None:
            for group in groups:
                one(group)

        return self.timer.seconds(work)

    # -- the kernel -----------------------------------------------------------------------------

    def kernel(
        self,
        transfer: KVTransfer,
        dev_idx: torch.Tensor,
        host_idx: torch.Tensor,
        to_host: bool,
        per_layer: bool,
    ) -> float:
        """Seconds of the kernel moving every layer, in one launch or one launch per layer."""

        def work() -> None:
            layers: Sequence[int | None] = range(self.device.layer_num) if per_layer else [None]
            for layer in layers:
                if to_host:
                    transfer.backup(dev_idx, host_idx, layer=layer)
                else:
                    transfer.load(host_idx, dev_idx, layer=layer)

        return self.timer.seconds(work)

    def check(self, transfer: KVTransfer, view: HostView) -> None:
        """Refuse to time a kernel that moves the wrong bytes: compare a few pages each way."""
        dev_idx, host_idx = self.indices(min(16, max(self.args.pages)))
        page, offset = (host_idx // self.page_size).cpu(), (host_idx % self.page_size).cpu()
        rows = view.rows()
        for to_host in (True, False):
            if to_host:
                transfer.backup(dev_idx, host_idx)
            else:
                transfer.load(host_idx, dev_idx)
            torch.cuda.synchronize()
            for kv in range(self.device.num_kv):
                for layer in range(self.device.layer_num):
                    device_rows = self.device.rows(kv, layer)[dev_idx].cpu()
                    host_rows = rows[kv, layer][page, offset].reshape(device_rows.shape)
                    if not torch.equal(device_rows.view(torch.uint8), host_rows.view(torch.uint8)):
                        direction = "d2h" if to_host else "h2d"
                        raise SystemExit(
                            f"kernel {direction} moved wrong bytes: kv {kv} layer {layer}"
                        )

    def supported(self, layouts: Sequence[str]) -> list[str]:
        """Keep the layouts this shape's host pool can take (MLA has no page_head)."""
        return [name for name in layouts if not (self.shape.mla and name == Layout.PAGE_HEAD)]

    def measure(self, layouts: Sequence[str], out: list[Case], log: Callable[[Case], None]) -> None:
        """Run every case of this shape and page size, in the layouts it supports."""
        shape, element = self.shape, self.device.dtype.itemsize
        for layout in self.supported(layouts):
            pool = self.host_pool(layout)
            view = HostView.from_pool(pool)
            transfer = KVTransfer(self.device, pool, backend="triton")
            self.check(transfer, view)
            for pages in self.args.pages:
                dev_idx, host_idx = self.indices(pages)
                nbytes = pages * self.page_size * shape.token_nbytes(element)
                loop = {}
                copies = pages * shape.layers * shape.kv
                for to_host in (True, False):
                    if copies <= self.args.loop_limit:
                        seconds = self.page_loop(
                            view,
                            self.device_pages[:pages],
                            self.host_pages[:pages],
                            to_host,
                        )
                        loop[to_host] = nbytes / seconds / 1e9
                for mode in ("all", "layer"):
                    per_layer = mode == "layer"
                    launches = shape.layers if per_layer else 1
                    for to_host in (True, False):
                        # The yardsticks do not depend on the host layout: measure them once.
                        key = (pages, mode, to_host)
                        if key not in self.yardsticks:
                            self.yardsticks[key] = (
                                nbytes / self.contiguous(nbytes, to_host, launches) / 1e9,
                                nbytes / self.gather_bulk(dev_idx, to_host, per_layer) / 1e9,
                            )
                        contig, gather = self.yardsticks[key]
                        case = Case(
                            shape=shape.name,
                            page_size=self.page_size,
                            pages=pages,
                            layout=layout,
                            direction="d2h" if to_host else "h2d",
                            mode=mode,
                            nbytes=nbytes,
                            contig=contig,
                            loop=loop.get(to_host),
                            gather=gather,
                        )
                        for budget in self.args.budgets:
                            transfer.sm_budget = budget
                            seconds = self.kernel(transfer, dev_idx, host_idx, to_host, per_layer)
                            case.kernel[_budget_name(budget)] = nbytes / seconds / 1e9
                        out.append(case)
                        log(case)
            del transfer, view, pool

    def concurrent(self, layout: str) -> Row:
        """GB/s of D2H and H2D at once on two streams: kernels vs contiguous copies.

        The D2H kernel runs on 8 SMs, unpaced or paced to each ``--both-caps`` GB/s; the H2D
        kernel on each ``--both-load-sms`` budget. Pacing the writes and giving the reads more
        SMs both shorten the read round trip the H2D kernel is bound by (docs/performance.md).
        """
        pages = max(self.args.pages)
        pool = self.host_pool(layout)
        out_dev, out_host = self.indices(pages)
        in_dev, in_host = self.indices(pages, second=True)
        nbytes = pages * self.page_size * self.shape.token_nbytes(self.device.dtype.itemsize)
        backup = KVTransfer(self.device, pool, backend="triton", sm_budget=8)
        pinned, staging = self.pinned[:nbytes], self.staging[:nbytes]
        pinned2, staging2 = self.second_pinned[:nbytes], self.second_staging[:nbytes]
        result: Row = {
            "shape": self.shape.name,
            "page_size": self.page_size,
            "pages": pages,
            "layout": layout,
            "nbytes_each_way": nbytes,
        }
        pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "contig": (
                lambda: pinned.copy_(staging, non_blocking=True),
                lambda: staging2.copy_(pinned2, non_blocking=True),
            ),
        }
        for sms in self.args.both_load_sms:
            load = KVTransfer(self.device, pool, backend="triton", sm_budget=sms)
            for cap in self.args.both_caps:
                pairs[_both_name(cap, sms)] = (
                    functools.partial(backup.backup, out_dev, out_host, max_gbps=cap),
                    functools.partial(load.load, in_host, in_dev),
                )
        for name, (d2h, h2d) in pairs.items():
            d2h_s, h2d_s, both_s = two_streams(d2h, h2d, self.args.samples)
            result[f"{name}_total"] = 2 * nbytes / both_s / 1e9
            result[f"{name}_d2h"] = nbytes / d2h_s / 1e9
            result[f"{name}_h2d"] = nbytes / h2d_s / 1e9
        return result


def _both_name(cap: float | None, load_sms: int) -> str:
    return f"kernel_cap{cap or 0:g}_load{load_sms}"


def two_streams(
    first: Callable[[], object], second: Callable[[], object], samples: int
) -> tuple[float, float, float]:
    """Median seconds of ``first`` and ``second`` started together on two streams, and of both."""
    streams = (_stream(), _stream())
    runs: list[tuple[float, float]] = []
    for _ in range(samples + 1):
        current = torch.cuda.current_stream()
        start = _event()
        ends = (_event(), _event())
        start.record(current)
        for stream, work, end in zip(streams, (first, second), ends, strict=True):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                work()
                end.record(stream)
        for stream in streams:
            current.wait_stream(stream)
        torch.cuda.synchronize()
        runs.append(
            (float(start.elapsed_time(ends[0])) / 1e3, float(start.elapsed_time(ends[1])) / 1e3)
        )
    timed = runs[1:]
    return (
        statistics.median(t for t, _ in timed),
        statistics.median(t for _, t in timed),
        statistics.median(max(pair) for pair in timed),
    )


def _summary(cases: Sequence[Case]) -> list[str]:
    """Per page size and SM budget, the worst kernel/contiguous ratio over cases of >= 64 pages."""
    lines = ["", "worst case at >= 64 pages (kernel GB/s as % of the contiguous copy):"]
    for page_size in sorted({c.page_size for c in cases}):
        chosen = [c for c in cases if c.page_size == page_size and c.pages >= 64]
        if not chosen:
            continue
        parts = []
        for budget in chosen[0].kernel:
            worst = min(chosen, key=lambda c: c.kernel[budget] / c.contig)
            parts.append(
                f"{budget} {100 * worst.kernel[budget] / worst.contig:.1f}% "
                f"({worst.shape} {worst.layout} {worst.direction} {worst.mode} {worst.pages}p)"
            )
        lines.append(f"  page {page_size}: " + "; ".join(parts))
    return lines


def _write(path: Path, meta: Row, cases: list[Case], concurrent: list[Row]) -> None:
    document = {"meta": meta, "cases": [asdict(c) for c in cases], "concurrent": concurrent}
    path.write_text(json.dumps(document, indent=1))


def _budget_name(budget: int | None) -> str:
    return "all_sms" if budget is None else f"{budget}_sms"


def _header(budgets: Sequence[int | None]) -> str:
    names = " | ".join(f"{_budget_name(b).replace('_', ' ')} GB/s (%)" for b in budgets)
    return (
        "| shape | page | pages | layout | dir | mode | MiB | contig | loop | gather | "
        f"{names} |\n|" + "---|" * (10 + len(budgets))
    )


def _row(case: Case) -> str:
    kernel = " | ".join(
        f"{gbs:.1f} ({100 * gbs / case.contig:.0f})" for gbs in case.kernel.values()
    )
    loop = "-" if case.loop is None else f"{case.loop:.2f}"
    return (
        f"| {case.shape} | {case.page_size} | {case.pages} | {case.layout} | {case.direction} "
        f"| {case.mode} | {case.nbytes / 2**20:.1f} | {case.contig:.1f} | {loop} "
        f"| {case.gather:.1f} | {kernel} |"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the bench's command line (also how other tools build a :class:`Bench`)."""
    parser = argparse.ArgumentParser(
        prog="hicache kernels bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES)
    )
    parser.add_argument("--page-sizes", default="1,16,64", help="tokens per page (comma list)")
    parser.add_argument(
        "--pages", default="1,16,64,256,1024", help="pages per transfer (comma list)"
    )
    parser.add_argument("--layouts", default=",".join(layout.value for layout in Layout))
    parser.add_argument("--budgets", default="4,8,0", help="SM budgets; 0 means unlimited")
    parser.add_argument("--quick", action="store_true", help="64-token pages, 64 and 256 pages")
    parser.add_argument(
        "--both-caps",
        default="0,42",
        help="D2H paces (GB/s) for the both-directions run; 0 means unpaced",
    )
    parser.add_argument(
        "--both-load-sms", default="8,16", help="H2D SM budgets for the both-directions run"
    )
    parser.add_argument(
        "--loop-limit",
        type=int,
        default=40000,
        help="skip the per-page copy loop above this many copies (0: never run it)",
    )
    parser.add_argument("--eager", action="store_true", help="time plain calls, not graph replays")
    parser.add_argument("--samples", type=int, default=5, help="timed batches per median")
    parser.add_argument("--target-ms", type=float, default=4.0, help="length of one timed batch")
    parser.add_argument("--json", type=Path, default=Path("kernel_bench.json"), help="output file")
    args = parser.parse_args(argv)
    if args.quick:
        args.page_sizes, args.pages = "64", "64,256"
    args.shapes = [SHAPES[name] for name in args.shapes.split(",")]
    args.page_sizes = [int(v) for v in args.page_sizes.split(",")]
    args.pages = [int(v) for v in args.pages.split(",")]
    args.layouts = [Layout.parse(v).value for v in args.layouts.split(",")]
    args.budgets = [int(v) or None for v in args.budgets.split(",")]
    args.both_caps = [float(v) or None for v in args.both_caps.split(",")]
    args.both_load_sms = [int(v) for v in args.both_load_sms.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return a process exit code."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["hicache kernels bench", *(sys.argv[1:] if argv is None else argv)]),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "timing": "eager" if args.eager else "cuda-graph replay",
    }
    print(json.dumps(meta))
    print(_header(args.budgets), flush=True)
    cases: list[Case] = []
    concurrent: list[Row] = []
    for shape in args.shapes:
        for page_size in args.page_sizes:
            bench = Bench(args, shape, page_size)
            bench.measure(args.layouts, cases, lambda case: print(_row(case), flush=True))
            layouts = bench.supported(args.layouts)
            if page_size == max(args.page_sizes) and layouts:
                concurrent.append(bench.concurrent(layouts[0]))
            del bench
            torch.cuda.empty_cache()
            _write(args.json, meta, cases, concurrent)
    print(
        "\n| shape | page | pages | layout | D2H pace | H2D SMs "
        "| contig d2h+h2d GB/s (d2h, h2d) | kernels d2h+h2d GB/s (d2h, h2d) | % |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in concurrent:
        contig = float(row["contig_total"])
        for sms in args.both_load_sms:
            for cap in args.both_caps:
                name = _both_name(cap, sms)
                kernel = float(row[f"{name}_total"])
                print(
                    f"| {row['shape']} | {row['page_size']} | {row['pages']} | {row['layout']} "
                    f"| {'-' if cap is None else f'{cap:g} GB/s'} | {sms} "
                    f"| {contig:.1f} ({row['contig_d2h']:.1f}, {row['contig_h2d']:.1f}) "
                    f"| {kernel:.1f} ({row[f'{name}_d2h']:.1f}, {row[f'{name}_h2d']:.1f}) "
                    f"| {100 * kernel / contig:.0f} |"
                )
    for line in _summary(cases):
        print(line)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
