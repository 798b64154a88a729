"""A tiering spec whose worker copies with torch, so vLLM's offloading runs on a CPU-only vLLM.

vLLM's own offloading worker moves blocks between the device KV cache and the CPU primary tier
with CUDA copies, and its specs refuse to start where there is no GPU. :class:`CPUTieringSpec`
is vLLM's ``TieringOffloadingSpec`` with only the worker replaced: blocks are copied between
vLLM's CPU KV tensors and the worker's slot of the shared primary region, synchronously. The
scheduler side (primary tier, secondary tiers, lookups, async loads) is vLLM's, unchanged, so
tests of :class:`~hicache_storage.integrations.vllm.HiCacheTier` run the production path.
It is meant for tests and CPU development, not for serving.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUTieringSpec", "CopyWorker"]


class CopyWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM ships no type information
    """Copies whole blocks between vLLM's KV tensors and this worker's primary-tier slots."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError(
                f"the CPU copy worker moves one KV cache group, got "
                f"{len(kv_caches.group_data_refs)} (hybrid models need vLLM's GPU worker)"
            )
        self._region: SharedOffloadRegion | None = region
        self._per_chunk = blocks_per_chunk
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for cache in kv_caches.tensors:
            page = cache.page_size_bytes
            device = cache.tensor.view(torch.int8).view(-1, page)
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._pairs.append((device, host.unflatten(1, (blocks_per_chunk, page))))
        self._finished: list[TransferResult] = []

    def _slots(
        self, device: GPULoadStoreSpec, host: BlockIDsLoadStoreSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device blocks and, for each, its chunk and its block within the chunk."""
        blocks = np.asarray(device.block_ids, dtype=np.int64)
        first = int(device.block_indices[0])
        logical = first + np.arange(len(blocks))
        chunks = np.asarray(host.block_ids, dtype=np.int64)[
            logical // self._per_chunk - first // self._per_chunk
        ]
        return (
            torch.from_numpy(blocks),
            torch.from_numpy(chunks),
            torch.from_numpy(logical % self._per_chunk),
        )

    def _transfer(
        self, job_id: int, device: LoadStoreSpec, host: LoadStoreSpec, store: bool
    ) -> bool:
        start = time.perf_counter()
        assert isinstance(device, GPULoadStoreSpec) and isinstance(host, BlockIDsLoadStoreSpec)
        blocks, chunks, within = self._slots(device, host)
        size = 0
        for dev, cpu in self._pairs:
            if store:
                cpu[chunks, within] = dev[blocks]
            else:
                dev[blocks] = cpu[chunks, within]
            size += len(blocks) * dev.shape[1]
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - start))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Copy device blocks into primary-tier chunks (done when this returns)."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy primary-tier chunks into device blocks (done when this returns)."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call (all of them: each finished when submitted)."""
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Every transfer finished when it was submitted."""

    def shutdown(self) -> None:
        """Let go of the tensors over the shared region, then unmap it."""
        if self._region is not None:
            self._pairs.clear()
            self._region.cleanup()
            self._region = None


class CPUTieringSpec(TieringOffloadingSpec):  # type: ignore[misc]  # vLLM ships no type information
    """``TieringOffloadingSpec`` with :class:`CopyWorker` as its worker (runs without a GPU)."""

    _worker: OffloadingWorker | None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Map this worker's slot of the primary tier's shared region; copy with torch."""
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = CopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker
