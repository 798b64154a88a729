"""A tier's store call that raises what no layer turned into a miss: the planner still hears it.

The tier is built over a memory backend without an engine: only vLLM's engine config, which the
chunk format and the step budget come from, is stubbed.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob

from hicache_storage.integrations.vllm import tier as tier_module
from hicache_storage.integrations.vllm.namespace import ChunkFormat

CHUNKS, ROW = 8, 4096


def chunk_format(spec: object, row_bytes: int) -> ChunkFormat:
    return ChunkFormat(
        model="m",
        model_identity="m",
        dtype="bf16",
        kv_cache_dtype="auto",
        tokens_per_hash=16,
        blocks_per_chunk=1,
        groups=((16, ("l0",)),),
        worker_kv_bytes_per_block=row_bytes,
        row_bytes=row_bytes,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        replicated_layout=False,
        canonical_layout=True,
        kv_cache_layout="NHD",
        device="cpu",
        attention_layout="-",
        hash_algo="sha256",
        hash_seed="fixed",
    )


@pytest.fixture
def tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[tier_module.HiCacheTier]:
    engine = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=2048)
    )
    monkeypatch.setattr(tier_module, "chunk_format", chunk_format)
    monkeypatch.setattr(tier_module, "_engine_config", lambda: engine)
    rows = np.zeros((CHUNKS, ROW), dtype=np.uint8)
    built = tier_module.HiCacheTier(
        types.SimpleNamespace(), memoryview(rows), "hicache", None, backend="memory"
    )
    try:
        yield built
    finally:
        built.shutdown()


def store_job(job_id: int, req: ReqContext) -> TransferJob:
    keys = []
    for i in range(2):
        key = make_offload_key(f"{req.req_id}-{i}".encode().ljust(32, b"."), 0)
        req.set_offload_key_position(key, (i + 1) * 16)
        keys.append(key)
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.arange(2 * job_id, 2 * job_id + 2),
        is_promotion=False,
        req_context=req,
    )


def test_a_store_call_that_raises_ends_its_write_and_counts_its_chunks_failed(
    tier: tier_module.HiCacheTier,
) -> None:
    backend = tier.backend
    write = backend.batch_set_v1
    calls: list[int] = []

    def raising_once(names: list[str], rows: torch.Tensor) -> list[bool]:
        calls.append(len(names))
        if len(calls) == 1:
            raise RuntimeError("a client library's own exception")
        return write(names, rows)

    backend.batch_set_v1 = raising_once  # type: ignore[method-assign]
    tier.submit_store(store_job(1, ReqContext("a")))
    tier.drain_jobs()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    stats = tier.stats()
    assert stats["planner"]["gate"]["in_flight"] == 0, "the raising call's write has ended"
    assert stats["store_failed"] == 2 and stats["stored"] == 0
    tier.submit_store(store_job(2, ReqContext("b")))
    tier.drain_jobs()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, True)]
    assert calls == [2, 2], "the next store reaches the backend"
    assert tier.stats()["stored"] == 2
