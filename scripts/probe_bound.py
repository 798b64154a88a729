"""Concurrent writers into a bounded file backend: how far the disk ever goes past the bound.

    python scripts/probe_bound.py --root DIR [--seconds 60] [--writers 8] [--bound-mib 64]

WRITERS threads write distinct 1 MiB values for SECONDS into a ``file`` backend at DIR bounded at
BOUND MiB (no free-space floor), while another thread samples, every 2 ms, the blocks in use on
DIR's file system (``statvfs``: one atomic figure, unlike a walk of the files, which counts an
object evicted during the walk beside its successor) and the backend's own accounting (stored
plus reserved bytes). It prints the peaks and the overshoot against one value's size.

Used blocks are counted from the file system's figure at the start, so on a disk that other
processes write meanwhile their bytes count too: give DIR a tmpfs of its own for an exact figure
(``mount -t tmpfs -o size=256m tmpfs DIR``). docs/reliability.md cites its figure.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from hicache_storage import create_backend

VALUE = 1 << 20


def _used(path: Path) -> int:
    stat = os.statvfs(path)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def main() -> None:
    """Run the writers and print one line of peaks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--bound-mib", type=int, default=64)
    args = parser.parse_args()
    bound = args.bound_mib << 20
    root = args.root / "store"
    args.root.mkdir(parents=True, exist_ok=True)
    start_used = _used(args.root)
    backend = create_backend("file", {"root": str(root), "max_bytes": bound, "min_free_bytes": 0})
    stop = time.monotonic() + args.seconds
    stored = [0] * args.writers

    def write(number: int) -> None:
        value = os.urandom(VALUE)
        index = 0
        while time.monotonic() < stop:
            stored[number] += bool(backend.set(f"w{number}-{index}", value))
            index += 1

    writers = [threading.Thread(target=write, args=(n,)) for n in range(args.writers)]
    for thread in writers:
        thread.start()
    disk_peak = accounted_peak = samples = 0
    while any(thread.is_alive() for thread in writers):
        stats = backend.stats()
        accounted_peak = max(accounted_peak, stats["bytes"] + stats["reserved_bytes"])
        disk_peak = max(disk_peak, _used(args.root) - start_used)
        samples += 1
        time.sleep(0.002)
    for thread in writers:
        thread.join()
    evicted = backend.stats()["evictions"]
    backend.close()
    mib = 2**20
    print(
        f"{args.writers} writers x {args.seconds:g} s: {sum(stored)} values of 1 MiB stored, "
        f"{evicted} evicted, bound {args.bound_mib} MiB; peak on disk {disk_peak / mib:.2f} MiB "
        f"({samples} samples), accounted {accounted_peak / mib:.2f} MiB; overshoot "
        f"{max(0, disk_peak - bound) / mib:.2f} MiB against one value of 1 MiB"
    )


if __name__ == "__main__":
    main()
