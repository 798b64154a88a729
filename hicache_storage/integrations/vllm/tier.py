"""The secondary tier: whole chunks between vLLM's CPU primary tier and a backend, zero-copy.

:class:`HiCacheTier` runs in vLLM's scheduler process, where every method must return at once.
Existence queries go to vLLM's own :class:`AsyncLookupManager` (one ``batch_exists`` per request
and step, on its thread); loads and stores run ``batch_get_v1``/``batch_set_v1`` on the tier's
read and write threads over a host pool adopted in place on the primary tier's shared memory
(one page per chunk row, so a backend moves chunk bytes without a copy). Finished jobs wait in
a queue for :meth:`get_finished_jobs`. The backend is built with the default layers, so a
storage failure is a counted miss: a load that fails is a failed job (vLLM recomputes those
chunks), a store that fails is a chunk not kept.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import BackendClosedError, ConfigError
from hicache_storage.factory import open_backend
from hicache_storage.hostpool import MLAHostPool
from hicache_storage.integrations.vllm.config import tier_settings
from hicache_storage.integrations.vllm.namespace import ChunkFormat, chunk_key, hash_setting

__all__ = ["HiCacheTier", "chunk_format"]

logger = logging.getLogger(__name__)


def _attention_layout(vllm_config: Any, block_size: int) -> str:
    """Name the byte order the attention kernel gives a block; on CPU it depends on the ISA."""
    if not current_platform.is_cpu():
        return "-"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    return str(
        _get_attn_isa(
            model.dtype, block_size, model.get_head_size(), vllm_config.cache_config.cache_dtype
        )
    )


def _engine_config() -> Any:
    """Find the engine's ``VllmConfig``: the current one, else the connector's.

    vLLM gives a secondary tier only the offloading config, which lacks the block-hash algorithm
    and the attention geometry; the scheduler that builds the tier holds the whole config.

    Raises
    ------
    ConfigError
        If neither is found (the tier was not built by a vLLM engine).
    """
    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    frame = inspect.currentframe()
    while frame is not None:
        found = frame.f_locals.get("vllm_config")
        if isinstance(found, VllmConfig):
            return found
        frame = frame.f_back
    raise ConfigError("HiCacheTier must be created by a vLLM engine (no vLLM config found)")


def chunk_format(spec: OffloadingSpec, row_bytes: int) -> ChunkFormat:
    """Collect what a chunk's bytes mean from vLLM's offloading config and its engine config.

    Raises
    ------
    ConfigError
        If the block-hash setting gives keys that differ between processes
        (:func:`~hicache_storage.integrations.vllm.namespace.hash_setting`), or vLLM's engine
        config is not available (the tier must be built by vLLM's engine).
    """
    vllm_config = _engine_config()
    config = spec.config
    cache = vllm_config.cache_config
    algo = str(cache.prefix_caching_hash_algo)
    block_size = config.groups[0].tokens_per_block if config.groups else 0
    parallel = config.parallel
    return ChunkFormat(
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        tokens_per_hash=int(config.cache.tokens_per_hash),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        groups=tuple(
            (int(group.tokens_per_block), tuple(group.layer_names)) for group in config.groups
        ),
        worker_kv_bytes_per_block=int(config.worker_kv_bytes_per_block),
        row_bytes=row_bytes,
        world_size=int(parallel.world_size),
        tp_size=int(parallel.tp_size),
        pp_size=int(parallel.pp_size),
        pcp_size=int(parallel.pcp_size),
        dcp_size=int(parallel.dcp_size),
        replicated_layout=bool(config.replicated_layout),
        canonical_layout=bool(config.canonical_layout),
        kv_cache_layout=str(config.kv_cache_layout),
        device=str(current_platform.device_type),
        attention_layout=_attention_layout(vllm_config, block_size),
        hash_algo=algo,
        hash_seed=hash_setting(algo),
    )


def _adopt_rows(view: memoryview) -> MLAHostPool:
    """Adopt vLLM's primary tier in place as a host pool: page *i* is chunk row *i*.

    The pool sees each row as one "token" of one opaque region, so a backend moves a whole
    chunk (every worker's bytes, as vLLM lays them out) as one contiguous page object.
    """
    rows = torch.from_numpy(np.asarray(view).view(np.uint8))
    num_chunks, row_bytes = rows.shape
    return MLAHostPool.from_buffer(rows.view(num_chunks, 1, 1, row_bytes), 1, "page_first")


class _Lookups(AsyncLookupManager):  # type: ignore[misc]  # vLLM ships no type information
    """vLLM's async lookup bookkeeping, answered by one ``batch_exists`` per request batch."""

    def __init__(self, tier: HiCacheTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Keys in the request's order: the stored leading run hits, the rest miss."""
        return self._tier._exists(keys)


class HiCacheTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM ships no type information
    """A vLLM secondary tier over a hicache-storage backend (see the module docstring).

    vLLM builds it from a ``secondary_tiers`` entry; the entry's keys other than vLLM's are
    :data:`TIER_KEYS`. Construction fails with :class:`~hicache_storage.errors.ConfigError`
    (unknown keys, bad options, a missing extra, unstable block hashes) before serving starts.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **entry: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        settings = tier_settings(entry)
        self.locality = None if settings.locality is None else Locality(settings.locality)
        shape = primary_kv_view.shape
        if shape is None or len(shape) != 2:
            raise ConfigError(f"vLLM's primary tier view has shape {shape}, not (chunks, bytes)")
        num_chunks, row_bytes = shape
        self.format = chunk_format(offloading_spec, row_bytes)
        self._digest = self.format.digest
        backend = open_backend(settings.hicache)
        try:
            self._pool = _adopt_rows(primary_kv_view)
            backend.register_host_pool(self._pool)
        except BaseException:
            backend.close()
            raise
        self._backend: StorageBackend | None = backend
        self._readers = ThreadPoolExecutor(settings.read_threads, "hicache-vllm-read")
        self._writers = ThreadPoolExecutor(settings.write_threads, "hicache-vllm-write")
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._failed_loads: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        self._in_flight: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self._counts = {"loaded": 0, "load_failed": 0, "stored": 0, "store_failed": 0}
        self._lookups = _Lookups(self, tier_type)
        self._closed = False
        self._backend_stats: dict[str, Any] = {}
        logger.info(
            "HiCacheTier on %r: %d chunks of %d bytes, key namespace vllm-%s",
            self.backend,
            num_chunks,
            row_bytes,
            self._digest,
        )

    @property
    def backend(self) -> StorageBackend:
        """The backend (with its layers) the tier moves chunks to and from."""
        if self._backend is None:
            raise BackendClosedError("the vLLM tier has shut down")
        return self._backend

    # -- lookups (vLLM's lookup thread) ---------------------------------------------------------

    def _keys(self, keys: Iterable[OffloadKey]) -> list[str]:
        return [chunk_key(self._digest, bytes(key)) for key in keys]

    def _exists(self, keys: list[OffloadKey]) -> list[bool]:
        found = self.backend.batch_exists(self._keys(keys))
        return [i < found for i in range(len(keys))]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS once the request's query has been answered, RETRY until then."""
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's existence queries (one batch) to the lookup thread."""
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Offload each request's chunks as vLLM computes them (its default policy)."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop the request's lookup bookkeeping (queries in flight still finish)."""
        self._lookups.cleanup(req_context.req_id)

    # -- transfers (the tier's threads) ---------------------------------------------------------

    def _indices(self, chunk_ids: Collection[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(chunk_ids, dtype=np.int64))

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's chunks from the primary tier on a write thread."""
        self._submit(self._writers, self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's chunks into the primary tier on a read thread."""
        self._submit(self._readers, self._load, job_metadata)

    def _submit(self, pool: ThreadPoolExecutor, work: Any, job: TransferJob) -> None:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys for {len(job.chunk_ids)} chunks")
        with self._lock:
            future = pool.submit(work, job.job_id, keys, self._indices(job.chunk_ids))
            self._in_flight[job.job_id] = future
        future.add_done_callback(functools.partial(self._done, job.job_id))

    def _done(self, job_id: int, _: Future[None]) -> None:
        with self._lock:
            self._in_flight.pop(job_id, None)

    def _store(self, job_id: int, keys: list[OffloadKey], indices: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            stored = self.backend.batch_set_v1(self._keys(keys), indices)
        except Exception:
            logger.exception("HiCacheTier store job %d failed", job_id)
            stored = [False] * len(keys)
        ok = sum(stored)
        self._count(stored=ok, store_failed=len(keys) - ok)
        self._finished.put(
            JobResult(
                job_id=job_id,
                success=ok == len(keys),
                transfer_time=time.perf_counter() - start,
                transfer_bytes=ok * self.block_size_bytes,
            )
        )

    def _load(self, job_id: int, keys: list[OffloadKey], indices: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            loaded = self.backend.batch_get_v1(self._keys(keys), indices)
        except Exception:
            logger.exception("HiCacheTier load job %d failed", job_id)
            loaded = [False] * len(keys)
        ok = sum(loaded)
        self._count(loaded=ok, load_failed=len(keys) - ok)
        failed = [key for key, hit in zip(keys, loaded, strict=True) if not hit]
        self._finished.put(
            JobResult(
                job_id=job_id,
                success=not failed,
                successful_keys=(
                    tuple(key for key, hit in zip(keys, loaded, strict=True) if hit) or None
                    if failed
                    else None
                ),
                transfer_time=time.perf_counter() - start,
                transfer_bytes=ok * self.block_size_bytes,
            )
        )
        if failed:
            self._failed_loads.put(failed)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call; a failed load's keys become misses."""
        while True:
            try:
                failed = self._failed_loads.get_nowait()
            except queue.Empty:
                break
            self._lookups.mark_miss(failed)
        results = []
        while True:
            try:
                results.append(self._finished.get_nowait())
            except queue.Empty:
                return results

    def has_pending_work(self) -> bool:
        """Whether a load or store is still running (vLLM keeps stepping to collect it)."""
        with self._lock:
            return bool(self._in_flight) or not self._finished.empty()

    def drain_jobs(self) -> None:
        """Wait for every submitted job (each ends within the backend's timeouts)."""
        while True:
            with self._lock:
                pending = list(self._in_flight.values())
            if not pending:
                return
            for future in pending:
                future.exception()

    def stats(self) -> dict[str, Any]:
        """Chunks loaded, stored and failed, and the backend's own stats (hits, errors)."""
        with self._lock:
            counts = dict(self._counts)
        backend = self._backend
        return {**counts, "backend": backend.stats() if backend else self._backend_stats}

    def shutdown(self) -> None:
        """Finish running jobs, stop the threads, close the backend; idempotent.

        The tier also lets go of the primary tier's memory, which vLLM unmaps next.
        """
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown()
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        logger.info("HiCacheTier closing: %s", self.stats())
        self._backend_stats = self.backend.stats()
        self.backend.close()
        # The pool's tensor and the backend's registration export the primary tier's mmap;
        # vLLM cannot unmap it while any export is alive.
        self._backend = None
        del self._pool
        self._primary_kv_view = None
        gc.collect()
