"""What end-to-end page verification costs: v1 page I/O with and without the verify layer.

One host pool of the 8B shape's 64-token pages (8 MiB each, ``page_first``); the same backend
opened twice per round, with the default layers and with ``verify`` off, each writing a batch of
fresh pages with ``batch_set_v1`` and reading them back with ``batch_get_v1``, in alternating
rounds so both see the same machine load. Prints the median time of each call, GiB/s, the ratio
to the run without verification and the cost per page.

    .venv/bin/python scripts/bench_verify.py [--backend memory] [--config JSON] \
        [--pages 32] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hicache_storage import create_backend
from hicache_storage.config import LayerConfig
from hicache_storage.hostpool import MHAHostPool

PAGE_TOKENS = 64


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="memory")
    parser.add_argument("--config", default=None, help="the backend's options as JSON")
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    options = json.loads(args.config) if args.config else None
    pages = args.pages
    pool = MHAHostPool(
        2 * pages * PAGE_TOKENS, PAGE_TOKENS, 32, 8, 128, torch.bfloat16, "page_first", False
    )
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    source = torch.arange(pages * PAGE_TOKENS)
    target = torch.arange(pages * PAGE_TOKENS, 2 * pages * PAGE_TOKENS)
    times: dict[tuple[bool, str], list[float]] = {}
    for round_ in range(args.rounds):
        for verify in (True, False):
            backend = create_backend(
                args.backend, options, layers=LayerConfig(verify=verify, health=None)
            )
            try:
                backend.register_host_pool(pool)
                keys = [f"bench-verify-{round_}-{verify}-{i}" for i in range(pages)]
                for op, call, indices in (
                    ("batch_set_v1", backend.batch_set_v1, source),
                    ("batch_get_v1", backend.batch_get_v1, target),
                ):
                    began = time.perf_counter()
                    done = call(keys, indices)
                    times.setdefault((verify, op), []).append(time.perf_counter() - began)
                    if done != [True] * pages:
                        raise SystemExit(f"{op} with verify={verify} answered {done}")
                backend.clear()
            finally:
                backend.close()
    gib = pages * pool.page_nbytes / 2**30
    print(
        f"{args.backend}: {pages} pages of {pool.page_nbytes / 2**20:.0f} MiB, "
        f"{args.rounds} rounds, torch threads {torch.get_num_threads()}"
    )
    print(f"{'call':<14}{'verified':>16}{'unverified':>16}{'ratio':>8}{'ms a page':>11}")
    for op in ("batch_set_v1", "batch_get_v1"):
        on = statistics.median(times[(True, op)])
        off = statistics.median(times[(False, op)])
        print(
            f"{op:<14}{gib / on:>10.2f} GiB/s{gib / off:>10.2f} GiB/s"
            f"{off / on:>8.2f}{(on - off) / pages * 1e3:>11.2f}"
        )


if __name__ == "__main__":
    main()
