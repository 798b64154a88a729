"""What storage threads cost a forward that runs beside them: the GIL, measured.

A forward of the engine's model launches a few thousand kernels from one Python thread and hands
the GIL over at each. A storage thread that wants the GIL back often (after every ``open``, read
and ``close`` of a page) takes it each time, and the forward waits. This times one forward (64
new tokens over an 8,256-token context, the overflow workload's later queries) alone, beside
loops of the file backend's ``batch_get_v1`` of 128 pages of 8 MiB (1 GiB) from the page cache
and of its ``batch_set_v1`` of 2 pages (the engine's write-through), each with the native batch
(``kit.read_files``/``kit.write_files``: the GIL given up once a batch) and page by page on the
backend's I/O threads (the Python path), and beside a thread that only runs Python; then the
native read loops again at the engine's storage niceness (``CacheConfig.threads.nice``), in
calls of ``--batch-pages`` pages as the engine's read threads make them, and beside threads that
only copy memory with the GIL given up (``torch`` copies of 256 MiB): what the page copies cost
a forward through the memory bus alone. ``--decodes N`` times a step of N decodes over 8,256
tokens each instead (the batched, graph-replayed decode of the engine). Prints the median
forward time (and the time the CPU took to launch it) for each.

    python scripts/probe_gil_tax.py [--device cuda] [--model 8b|tiny] [--nice 10] [--decodes 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from hicache_storage import create_backend
from hicache_storage.engine import LlamaModel, ModelConfig
from hicache_storage.engine.model import Segment, next_token
from hicache_storage.engine.storage_io import lower_priority
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kernels import DevicePool
from hicache_storage.kit import pageio

PAGES = 128


def main() -> None:
    """Time the forward alone and beside each kind of storage thread; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--nice", type=int, default=10, help="niceness of the last rows' loops")
    parser.add_argument("--decodes", type=int, default=0, help="time N decodes, not 64 tokens")
    parser.add_argument("--batch-pages", type=int, default=32, help="pages a call in the rows so")
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # the engine's interval while its storage threads run
    config = ModelConfig.llama3_8b() if args.model == "8b" else ModelConfig.tiny()
    device = torch.device(args.device)
    model = LlamaModel(config, device)
    pool = DevicePool.mha(
        36864, config.layers, config.kv_heads, config.head_dim, config.dtype, device
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if args.decodes:  # one token each over its own 8,256-token context, as decodes run
        segments = [
            Segment(
                torch.randint(0, config.vocab_size, (1,), device=device),
                torch.arange(i * 8256, (i + 1) * 8256, device=device) % pool.size,
            )
            for i in range(args.decodes)
        ]
    else:
        segments = [
            Segment(
                torch.randint(0, config.vocab_size, (64,), device=device),
                torch.arange(0, 8256, device=device),
            )
        ]

    def forward_s() -> tuple[float, float]:
        times, launches = [], []
        for _ in range(args.repeat + 2):
            sync()
            began = time.perf_counter()
            logits = model.forward(segments, pool)
            launches.append(time.perf_counter() - began)
            next_token(logits[0])
            sync()
            times.append(time.perf_counter() - began)
        return statistics.median(times[2:]), statistics.median(launches[2:])

    root = tempfile.mkdtemp(prefix="probe-gil-")
    backend = create_backend("file", {"root": root})
    host = MHAHostPool(
        (PAGES + 4) * 64,
        64,
        config.layers,
        config.kv_heads,
        config.head_dim,
        config.dtype,
        "page_first",
        device.type == "cuda",
    )
    backend.register_host_pool(host)
    keys = [f"page{i}" for i in range(PAGES)]
    slots = torch.arange(0, PAGES * 64)
    backend.batch_set_v1(keys, slots)
    written = [f"new{i}" for i in range(2)]

    def get() -> None:
        backend.batch_get_v1(keys, slots)

    def get_in_calls() -> None:
        step = args.batch_pages
        for first in range(0, PAGES, step):
            backend.batch_get_v1(
                keys[first : first + step], slots[first * 64 : (first + step) * 64]
            )

    source = torch.empty(256 << 20, dtype=torch.uint8)
    target = torch.empty_like(source)

    def copy_memory() -> None:
        target.copy_(source)

    def put() -> None:
        for key in written:
            backend.delete(key)
        backend.batch_set_v1(written, torch.arange(PAGES * 64, (PAGES + 2) * 64))

    def python_only() -> None:
        sum(range(20_000))

    def beside(loops: list[Callable[[], None]], nice: int | None = None) -> tuple[float, float]:
        stop = threading.Event()

        def run(fn: Callable[[], None]) -> None:
            if nice is not None:
                lower_priority(nice)
            while not stop.is_set():
                fn()

        threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in loops]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        try:
            return forward_s()
        finally:
            stop.set()
            for thread in threads:
                thread.join()

    rows = [("alone", forward_s())]
    native = pageio._CHECKED
    for label, helper in (("native batch", native), ("page by page", None)):
        pageio._CHECKED = helper
        rows.append((f"beside 1 get loop, {label}", beside([get])))
        rows.append((f"beside 4 get loops, {label}", beside([get] * 4)))
        rows.append((f"beside 2 set loops, {label}", beside([put] * 2)))
    pageio._CHECKED = native
    rows.append(("beside 1 pure-Python thread", beside([python_only])))
    rows.append((f"beside 1 get loop, native, nice {args.nice}", beside([get], args.nice)))
    rows.append((f"beside 4 get loops, native, nice {args.nice}", beside([get] * 4, args.nice)))
    rows.append(
        (
            f"beside 4 loops of {args.batch_pages}-page gets, nice {args.nice}",
            beside([get_in_calls] * 4, args.nice),
        )
    )
    rows.append(
        (f"beside 4 memory copy loops, nice {args.nice}", beside([copy_memory] * 4, args.nice))
    )
    alone = rows[0][1][0]
    what = (
        f"step of {args.decodes} decodes over 8,256"
        if args.decodes
        else "forward of 64 tokens over 8,256"
    )
    print(f"{what:44s} {'ms':>8s} {'launch ms':>10s} {'x alone':>8s}")
    for name, (total, launch) in rows:
        print(f"{name:44s} {total * 1e3:8.1f} {launch * 1e3:10.1f} {total / alone:8.2f}")


if __name__ == "__main__":
    main()
