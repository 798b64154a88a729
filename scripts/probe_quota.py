"""Tenants with quotas on one shared directory: writer processes flood two, a third stays put.

    python scripts/probe_quota.py --root DIR [--seconds 60] [--writers 8] [--quota-mib 16]

Three tenants share DIR, each its own root (its namespace) under a quota of QUOTA MiB kept in
the root's shared ledger: WRITERS processes (half per tenant) write distinct 1 MiB values into
tenants ``a`` and ``b`` for SECONDS, each process a backend of its own, as engines on several
hosts would be; tenant ``quiet`` stores 8 values first (at most half its quota) and writes
nothing after. Meanwhile the
parent sums, every few milliseconds, the values' bytes in each flooded root (flat roots, so a
listing is cheap), and at the end reads every value of ``quiet``. It prints each tenant's peak
on disk against its quota, and whether ``quiet`` lost anything. docs/layers.md cites its figure.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from pathlib import Path

from hicache_storage import StorageBackend, create_backend
from hicache_storage.config import LayerConfig, QuotaConfig

VALUE = 1 << 20
RECORD = 32
"""The integrity record after each value in its file (``FileConfig.integrity``)."""


def _tenant(root: Path, quota: int) -> StorageBackend:
    layers = LayerConfig(quota=QuotaConfig(bytes=quota))
    options = {"root": str(root), "fanout": False, "metadata_cache": False, "min_free_bytes": 0}
    return create_backend("file", options, layers=layers)


def _flood(root: str, quota: int, writer: int, seconds: float, counts: list[int]) -> None:
    backend = _tenant(Path(root), quota)
    value = os.urandom(VALUE)
    stop = time.monotonic() + seconds
    index = stored = 0
    while time.monotonic() < stop:
        stored += bool(backend.set(f"w{writer}-{index}", value))
        index += 1
    counts[writer] = stored
    backend.close()


def _values_bytes(root: Path) -> int:
    total = 0
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                total += entry.stat().st_size - RECORD
            except FileNotFoundError:
                continue
    return total


def main() -> None:
    """Run the tenants and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--quota-mib", type=int, default=16)
    args = parser.parse_args()
    quota = args.quota_mib << 20
    roots = {name: args.root / name for name in ("a", "b", "quiet")}
    quiet = _tenant(roots["quiet"], quota)
    kept = {f"q{i}": os.urandom(VALUE) for i in range(max(1, min(8, args.quota_mib // 2)))}
    for key, value in kept.items():
        assert quiet.set(key, value)
    for name in ("a", "b"):
        _tenant(roots[name], quota).close()  # the roots exist before anyone samples them
    context = multiprocessing.get_context("spawn")
    counts = context.Manager().list([0] * args.writers)
    writers = [
        context.Process(
            target=_flood,
            args=(str(roots["ab"[w % 2]]), quota, w, args.seconds, counts),
        )
        for w in range(args.writers)
    ]
    for process in writers:
        process.start()
    peaks = {"a": 0, "b": 0}
    samples = 0
    while any(process.is_alive() for process in writers):
        for name in peaks:
            peaks[name] = max(peaks[name], _values_bytes(roots[name]))
        samples += 1
        time.sleep(0.002)
    for process in writers:
        process.join()
    lost = [key for key, value in kept.items() if quiet.get(key) != value]
    quiet.close()
    mib = 2**20
    for name, peak in peaks.items():
        stored = sum(counts[w] for w in range(args.writers) if "ab"[w % 2] == name)
        print(
            f"tenant {name}: {args.writers // 2} writer processes x {args.seconds:g} s, {stored} "
            f"values of 1 MiB stored, quota {args.quota_mib} MiB; peak on disk "
            f"{peak / mib:.2f} MiB ({samples} samples); overshoot "
            f"{max(0, peak - quota) / mib:.2f} MiB against one value of 1 MiB"
        )
    print(f"tenant quiet: {len(kept) - len(lost)} of {len(kept)} values intact")


if __name__ == "__main__":
    main()
