"""What integrity records cost: get and set throughput with and without them, in the same run.

For each backend whose medium can return another key's bytes (file, 3fs with in-process
metadata) and each page size, two instances over separate directories, one with
``integrity=true`` (the default) and one without, are filled with the same values and read
back in alternating rounds (so both see the same page-cache state and machine load). Prints
GB/s of each and the ratio; the goal is a get ratio of at least 0.95.

    .venv/bin/python scripts/bench_integrity.py [--rounds 7] [--batch 16] [--sizes 1MiB,4MiB]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.bench.backend import parse_sizes
from hicache_storage.bench.report import format_size


def _options(name: str, root: str, size: int, batch: int, integrity: bool) -> dict[str, Any]:
    if name == "file":
        return {"root": root, "integrity": integrity}
    slots = 2 * batch
    return {
        "path": root,
        "slot_bytes": size,
        "file_size": slots * size,
        "file_count": 1,
        "io_threads": 2,
        "integrity": integrity,
    }


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(name: str, size: int, batch: int, rounds: int) -> dict[str, float]:
    """Return median GB/s of batch_get and batch_set with and without integrity records."""
    values = [os.urandom(size) for _ in range(batch)]
    outs = [bytearray(size) for _ in range(batch)]
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-integrity-") as scratch:
        backends: dict[bool, StorageBackend] = {
            flag: create_backend(
                name, _options(name, os.path.join(scratch, str(flag)), size, batch, flag)
            )
            for flag in (True, False)
        }
        try:
            for rnd in range(rounds):
                for flag in (True, False) if rnd % 2 == 0 else (False, True):
                    backend = backends[flag]
                    keys = [f"r{rnd}-{i}" for i in range(batch)]
                    set_s = _timed(lambda b=backend, k=keys: b.batch_set(k, values))
                    get_s = _timed(lambda b=backend, k=keys: b.batch_get(k, outs))
                    assert all(bytes(o) == v for o, v in zip(outs, values, strict=True))
                    seconds.setdefault(f"set-{flag}", []).append(set_s)
                    seconds.setdefault(f"get-{flag}", []).append(get_s)
                    for key in keys:
                        backend.delete(key)
        finally:
            for backend in backends.values():
                backend.close()
    moved = size * batch / 1e9
    return {label: moved / statistics.median(times) for label, times in seconds.items()}


def main() -> None:
    """Run every backend and page size; print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sizes", default="1MiB,4MiB")
    args = parser.parse_args()
    print("backend  page    get GB/s on/off  ratio   set GB/s on/off  ratio")
    for name in ("file", "3fs"):
        for size in parse_sizes(args.sizes):
            r = measure(name, size, args.batch, args.rounds)
            print(
                f"{name:7}  {format_size(size):6}  {r['get-True']:6.2f} {r['get-False']:6.2f}"
                f"  {r['get-True'] / r['get-False']:5.2f}   {r['set-True']:6.2f}"
                f" {r['set-False']:6.2f}  {r['set-True'] / r['set-False']:5.2f}"
            )


if __name__ == "__main__":
    main()
