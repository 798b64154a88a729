"""What the engine tests share: pools, seeded prompts, and an engine in a process of its own.

:func:`serve_job` is the body of one engine process of ``test_shared_storage.py``: it reads a
JSON job (the backend's name and options among it), serves the job's prompts through a fresh
:class:`~hicache_storage.engine.engine.Engine` over that backend, closes it (flushing its
backups to storage) and writes what it saw to a JSON result file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.engine.cache import CacheConfig, TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel, ModelConfig
from hicache_storage.engine.policies import PrefetchPolicy, WritePolicy
from hicache_storage.engine.scheduler import Request, RequestState, Scheduler
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kernels import DevicePool

__all__ = [
    "CONFIG",
    "PAGE",
    "build_cache",
    "conversations",
    "host_pool",
    "serve",
    "serve_job",
    "stored_prompt",
]

PAGE = 4
CONFIG = ModelConfig.tiny()
_WAIT_S = 60.0


def host_pool(tokens: int, layout: str = "layer_first") -> MHAHostPool:
    """Return a host pool of ``tokens`` slots shaped for :data:`CONFIG`."""
    c = CONFIG
    return MHAHostPool(tokens, PAGE, c.layers, c.kv_heads, c.head_dim, c.dtype, layout, False)


def build_cache(
    device_tokens: int,
    host_tokens: int,
    backend: StorageBackend | None,
    **config: Any,
) -> TierCache:
    """Return a tier cache over fresh pools (no host pool when ``host_tokens`` is 0)."""
    c = CONFIG
    device = DevicePool.mha(device_tokens, c.layers, c.kv_heads, c.head_dim, c.dtype)
    host = host_pool(host_tokens) if host_tokens else None
    config.setdefault("prefetch", PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE))
    return TierCache(device, host, backend, CacheConfig(PAGE, **config))


def stored_prompt(
    model: LlamaModel, length: int, step: int
) -> tuple[StorageBackend, list[int], list[int]]:
    """Return a memory store holding a seeded prompt's pages, the prompt and its oracle output.

    The prompt (``length`` tokens, ``step`` apart in the vocabulary) is served once through an
    engine over the store, whose close writes its pages.
    """
    memory = create_backend("memory")
    prompt = [7 + (i * step) % (CONFIG.vocab_size - 7) for i in range(length)]
    with Engine(model, build_cache(512, 512, memory)) as engine:
        expected = engine.generate(prompt, 4)
    return memory, prompt, expected


def serve(scheduler: Scheduler, *requests: Request, wait_s: float = 10.0) -> None:
    """Step ``scheduler`` until every one of ``requests`` has finished or failed."""
    deadline = time.monotonic() + wait_s
    while any(r.state not in (RequestState.FINISHED, RequestState.FAILED) for r in requests):
        assert time.monotonic() < deadline, "a request never finished"
        scheduler.step()


def conversations(rounds: int, clients: int, seed: int = 0) -> list[list[int]]:
    """Return multi-turn prompts: a shared system prompt, each round a client's history + a turn.

    The prompts of one client grow round by round, so later rounds reuse earlier prefixes.
    """
    rng = random.Random(seed)
    system = [rng.randrange(CONFIG.vocab_size) for _ in range(3 * PAGE + 1)]
    histories = [list(system) for _ in range(clients)]
    prompts = []
    for _ in range(rounds):
        for history in histories:
            history.extend(rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(3, 9)))
            prompts.append(list(history))
    return prompts


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {_WAIT_S} s")
        time.sleep(0.01)


def serve_job(job_json: str, result_path: str) -> None:
    """Serve a job's prompts through a fresh engine over its backend; write the outcome as JSON.

    The job's keys: ``backend`` and ``options`` (what :func:`create_backend` takes), ``env``
    (variables to set first, such as credentials), ``prompts``, ``new_tokens``,
    ``write_policy``, ``prefetch_policy``, ``device_tokens``, ``host_tokens``, and for a run
    beside another process ``pause_after`` (prompts served before ``touch`` is created and
    ``wait_for`` is awaited) and ``announce`` (a file created just before serving starts).
    """
    job = json.loads(job_json)
    torch.set_num_threads(1)
    os.environ.update(job.get("env", {}))
    model = LlamaModel(CONFIG)
    backend = create_backend(job["backend"], job["options"])
    cache = build_cache(
        job["device_tokens"],
        job["host_tokens"],
        backend,
        write=WriteConfig(WritePolicy(job["write_policy"])),
        prefetch=PrefetchConfig(PrefetchPolicy(job["prefetch_policy"])),
    )
    outputs: list[list[int]] = []
    try:
        with Engine(model, cache) as engine:
            if job.get("announce"):
                Path(job["announce"]).touch()
            for i, prompt in enumerate(job["prompts"]):
                if i == job.get("pause_after"):
                    Path(job["touch"]).touch()
                    _wait_for(job["wait_for"])
                outputs.append(engine.generate(prompt, job["new_tokens"]))
        result = {
            "pid": os.getpid(),
            "outputs": outputs,
            "stats": dataclasses.asdict(cache.stats),
            "threads_alive": sum(t.is_alive() for t in cache.io.threads) if cache.io else 0,
            "locked_tokens": cache.tree.locked_tokens,
        }
    finally:
        backend.close()
    Path(result_path).write_text(json.dumps(result))
