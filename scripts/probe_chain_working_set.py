"""A working set four times the local tier: the chain against each of its tiers alone.

    python scripts/probe_chain_working_set.py [--values 256] [--reads 4000] [--skew 1.1]

Starts a Redis server of its own (``redis-server`` on 127.0.0.1, by PID), then serves the same
seeded reads three ways: a ``file`` tier bounded at a quarter of the working set alone, Redis
alone, and a ``chain`` of the two (the file tier first, promotion after 2 hits). VALUES values of
1 MiB are written once through each; the reads pick keys Zipf-distributed with exponent SKEW (a
few hot prefixes, a long tail), as a cache's reads do. It prints each one's hit rate and mean
and p99 read latency. docs/reliability.md cites its figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache_storage import create_backend
from hicache_storage.backends.redis import provision

VALUE = 1 << 20


def _serve(backend: Any, keys: list[str], reads: np.ndarray) -> tuple[float, float, float]:
    """Write every key once, then read in ``reads`` order; hit rate, mean and p99 seconds."""
    for index, key in enumerate(keys):
        backend.set(key, bytes([index % 251]) * VALUE)
    out = bytearray(VALUE)
    took = np.empty(len(reads))
    hits = 0
    for n, pick in enumerate(reads):
        start = time.perf_counter()
        got = backend.get(keys[pick], out)
        took[n] = time.perf_counter() - start
        hits += got is not None and out[0] == pick % 251
    return hits / len(reads), float(took.mean()), float(np.quantile(took, 0.99))


def main() -> None:
    """Run the three configurations and print one row each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=256)
    parser.add_argument("--reads", type=int, default=4000)
    parser.add_argument("--skew", type=float, default=1.1)
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    ranks = rng.permutation(args.values)
    reads = ranks[np.minimum(rng.zipf(args.skew, args.reads), args.values) - 1]
    keys = [f"ws-{i}" for i in range(args.values)]
    bound = args.values * VALUE // 4
    with tempfile.TemporaryDirectory() as scratch, provision.standalone(Path(scratch)) as redis:
        remote = {"backend": "redis", "options": {**redis.options, "prefix": "ws"}}
        local = {"root": f"{scratch}/local", "max_bytes": bound, "min_free_bytes": 0}
        runs = {
            "file alone (bounded)": ("file", {**local, "root": f"{scratch}/alone"}),
            "redis alone": ("redis", remote["options"]),
            "chain file -> redis": (
                "chain",
                {"tiers": [{"backend": "file", "options": local}, remote]},
            ),
        }
        print(
            f"{args.values} values of 1 MiB, file tier bounded at {bound >> 20} MiB, "
            f"{args.reads} Zipf({args.skew}) reads"
        )
        for name, (backend_name, options) in runs.items():
            with create_backend(backend_name, options) as backend:
                hit, mean, p99 = _serve(backend, keys, reads)
                backend.clear()
            print(
                f"{name:22} hit rate {hit:6.1%}  mean {mean * 1e3:6.3f} ms  p99 {p99 * 1e3:6.3f} ms"
            )


if __name__ == "__main__":
    main()
