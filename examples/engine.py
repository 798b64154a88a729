"""Serve multi-turn conversations through the tier engine and check them against recompute.

A tiny seeded Llama-style model answers three clients for four rounds each, with a device pool
too small for their histories: pages are evicted to the host pool and on to the file backend,
and later rounds bring them back. Every answer is compared with a run that recomputes
everything. Run: ``python examples/engine.py [ROOT]`` (a temporary directory by default).
"""

from __future__ import annotations

import random
import sys
import tempfile

from hicache_storage import create_backend
from hicache_storage.engine.build import build_cache
from hicache_storage.engine.cache import CacheConfig
from hicache_storage.engine.cache_config import PrefetchConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel, ModelConfig
from hicache_storage.engine.policies import PrefetchPolicy

PAGE = 4


def conversations(clients: int, rounds: int) -> list[list[list[int]]]:
    """Per client, the new turn of each round: a shared system prompt opens every history."""
    rng = random.Random(0)
    system = [rng.randrange(512) for _ in range(13)]
    return [
        [system + [rng.randrange(512) for _ in range(6)]]
        + [[rng.randrange(512) for _ in range(rng.randrange(3, 9))] for _ in range(rounds - 1)]
        for _ in range(clients)
    ]


def serve(engine: Engine, turns: list[list[list[int]]]) -> list[list[int]]:
    """Run the rounds client by client, each prompt the history so far plus the new turn."""
    histories: list[list[int]] = [[] for _ in turns]
    answers = []
    for round_ in range(len(turns[0])):
        for client, history in enumerate(histories):
            history.extend(turns[client][round_])
            answer = engine.generate(history, 4)
            history.extend(answer)
            answers.append(answer)
    return answers


def main(root: str) -> None:
    config = ModelConfig.tiny()
    model = LlamaModel(config)
    with create_backend("file", {"root": root}) as backend:
        # Wait for every storage read: this tiny model recomputes a page faster than the file
        # store reads it, so the default `adaptive` policy would (rightly) recompute instead,
        # and the example is here to show pages making the round trip.
        policies = CacheConfig(PAGE, prefetch=PrefetchConfig(policy=PrefetchPolicy.WAIT_COMPLETE))
        cache = build_cache(config, policies, device_tokens=64, host_tokens=48, backend=backend)
        turns = conversations(clients=3, rounds=4)
        with Engine(model, cache) as engine:  # closing flushes the queued storage writes
            cached = serve(engine, turns)
        recomputed = serve(Engine(model, None), turns)
    s = cache.stats
    print(
        f"hit tokens: device {s.device_hit_tokens}, host {s.host_hit_tokens}, "
        f"storage {s.storage_hit_tokens}; computed {s.computed_tokens}"
    )
    print(f"pages: loaded {s.pages_loaded}, backed up {s.pages_backed_up}, stored {s.pages_stored}")
    print(f"identical to recompute: {cached == recomputed}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
