"""The secondary tier: whole chunks between vLLM's CPU primary tier and a backend, zero-copy.

:class:`HiCacheTier` runs in vLLM's scheduler process, where every method must return at once.
Existence queries go to vLLM's own :class:`AsyncLookupManager` (one ``batch_exists`` per request
and step, on its thread); loads and stores run ``batch_get_v1``/``batch_set_v1`` on the tier's
read and write threads over a host pool adopted in place on the primary tier's shared memory
(one page per chunk row, so a backend moves chunk bytes without a copy). Finished jobs wait in
a queue for :meth:`get_finished_jobs`. The backend is built with the default layers, so a
storage failure is a counted miss: a load that fails is a failed job (vLLM recomputes those
chunks), a store that fails is a chunk not kept.

Unless the entry says ``"planner": false``, the project's planner decides what moves
(:mod:`~hicache_storage.integrations.vllm.planning`): a lookup hits only the leading stored chunks
whose fetch beats recomputing them, each step's store jobs are offered to it at once and what it
sheds is reported to vLLM as not stored right away, and the tier's back-pressure detector is the
planner's (:mod:`~hicache_storage.integrations.vllm.pressure`).
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
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
from hicache_storage.errors import BackendClosedError, ConfigError, HiCacheError
from hicache_storage.factory import open_backend
from hicache_storage.hostpool import MLAHostPool
from hicache_storage.integrations.vllm.config import TierSettings, tier_settings
from hicache_storage.integrations.vllm.namespace import ChunkFormat, chunk_key, hash_setting
from hicache_storage.integrations.vllm.planning import TierPlanner
from hicache_storage.integrations.vllm.prefill import PrefillClock
from hicache_storage.integrations.vllm.pressure import PlannerPressure
from hicache_storage.keys import kv_settings, model_identity, weights_fingerprint
from hicache_storage.layers import watch_planner
from hicache_storage.planner import Planner, WritePlan

__all__ = ["HiCacheTier", "chunk_format"]

logger = logging.getLogger(__name__)

SPIN_S = 0.001
"""Steps of vLLM's scheduler closer together than this are taken for an idle spin; while storage
work runs, such a step waits up to this long for it (see ``HiCacheTier._yield_while_spinning``)."""


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


def _model_identity(vllm_config: Any) -> str:
    """Name the served model by its weights and KV-shaping settings, not its path.

    vLLM applies ``--hf-overrides`` to ``model_config.hf_config``, so an overridden RoPE setting
    is read as served; the quantization method joins the config's own settings.
    """
    model = vllm_config.model_config
    revision = getattr(model, "revision", None)
    settings = kv_settings(model.hf_config)
    settings["quantization"] = str(getattr(model, "quantization", None))
    return model_identity(str(model.model), weights_fingerprint(model.model, revision), settings)


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
        model_identity=_model_identity(vllm_config),
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


@dataclass
class _Store:
    """A store job's chunks: its keys, their primary-tier rows, and which of them to write."""

    job_id: int
    keys: list[OffloadKey]
    chunks: Any
    admitted: list[bool] | None = None  # None: every chunk

    def written(self) -> list[int]:
        """Positions of the chunks to write."""
        if self.admitted is None:
            return list(range(len(self.keys)))
        return [i for i, ok in enumerate(self.admitted) if ok]


def _tier_planner(settings: TierSettings, chunk: ChunkFormat) -> TierPlanner:
    """Build the tier's planner: a chunk is its page; prefill at the entry's rate or derived."""
    sizes = [tokens * chunk.blocks_per_chunk for tokens, _ in chunk.groups]
    chunk_tokens = min(sizes, default=chunk.tokens_per_hash * chunk.blocks_per_chunk)
    planner = Planner(max(chunk_tokens, 1))
    step_tokens = int(_engine_config().scheduler_config.max_num_batched_tokens)
    prefill = PrefillClock(planner, chunk_tokens, step_tokens, rate=settings.prefill_tokens_per_s)
    return TierPlanner(planner, prefill)


class _JobThreads:
    """Threads taking jobs from one queue in order: a pool without futures.

    A chunk job is small; a ``Future`` and its callbacks per job cost more than the tier's own
    work (measured: 22 us of hand-off per job with ``ThreadPoolExecutor``).
    """

    def __init__(self, count: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        """Queue ``work`` for the next free thread."""
        self._queue.put(work)

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            work()

    def stop(self) -> None:
        """Finish the queued work, then end the threads."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


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
    :data:`~hicache_storage.integrations.vllm.config.TIER_KEYS`. Construction fails before
    serving starts with :class:`~hicache_storage.errors.ConfigError` (unknown keys, bad options,
    an unknown backend, unstable block hashes) or
    :class:`~hicache_storage.errors.MissingDependencyError` (naming the extra to install). A
    store that cannot be reached does not fail it: the tier starts with the store detached
    (every lookup a counted miss, logged as an error) and attaches it once it answers, unless
    the entry says ``"strict_start": true`` (then the backend's own error fails start-up).

    With the planner (the default), the tier's back-pressure detector is
    :class:`~hicache_storage.integrations.vllm.pressure.PlannerPressure` unless the entry names
    vLLM's ``backpressure``: the planner, not vLLM's fixed water marks, decides which stores are
    shed, at the step's end where it sees their keys, and the detector reports its decisions to
    vLLM's metrics and logs.
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
        self._key_prefix = chunk_key(self._digest, b"")
        backend = open_backend(settings.hicache)
        try:
            self._pool = _adopt_rows(primary_kv_view)
            backend.register_host_pool(self._pool)
        except BaseException:
            backend.close()
            raise
        self._backend: StorageBackend | None = backend
        self._readers = _JobThreads(settings.read_threads, "hicache-vllm-read")
        self._writers = _JobThreads(settings.write_threads, "hicache-vllm-write")
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._failed_loads: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._jobs = 0  # jobs submitted and not yet finished
        self._busy = 0  # existence queries and jobs running
        self._progress = threading.Event()  # set when one of them ends
        self._last_poll = 0.0
        self._asked = False  # a lookup of the last step is waiting for its query
        self._counts = {
            "loaded": 0,
            "load_failed": 0,
            "stored": 0,
            "store_failed": 0,
            "store_shed": 0,
        }
        self._lookups = _Lookups(self, tier_type)
        self._closed = False
        self._backend_stats: dict[str, Any] = {}
        self._plan: TierPlanner | None = None
        self._stores: list[_Store] = []  # this step's store jobs, offered together
        self._prober: threading.Thread | None = None
        if settings.planner:
            self._plan = _tier_planner(settings, self.format)
            watch_planner(self._plan.planner, backend.name)
            if backpressure_detector is None:
                self._bp_detector = PlannerPressure(self._plan.write_s_per_page, row_bytes)
            self._prober = threading.Thread(
                target=self._probe, name="hicache-vllm-probe", daemon=True
            )
            self._prober.start()
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
        prefix = self._key_prefix
        return [prefix + key.hex() for key in keys]

    def _exists(self, keys: list[OffloadKey]) -> list[bool]:
        """Answer the leading stored keys, with the planner only those whose fetch pays."""
        names = self._keys(keys)
        with self._lock:
            self._busy += 1
        try:
            start = time.perf_counter()
            found = self.backend.batch_exists(names)
            if self._plan is not None:
                found = self._plan.fetchable(names, found, time.perf_counter() - start)
        finally:
            with self._lock:
                self._busy -= 1
            self._progress.set()
        return [i < found for i in range(len(keys))]

    def _probe(self) -> None:
        """Time a read of a key never stored, so the planner prices the store before any load.

        The key is shorter than every chunk's, so no tier ever stores it. The read is a
        single-key ``get`` into a buffer of its own, never a row of vLLM's primary tier, and
        :meth:`shutdown` joins this thread before it closes the backend: nothing it does
        outlives the tier.
        """
        assert self._plan is not None
        key = f"{self._key_prefix}probe{secrets.token_hex(8)}"
        try:
            self._plan.probe(lambda: self.backend.get(key))
        except HiCacheError:
            logger.warning("HiCacheTier's probe of the store failed", exc_info=True)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS once the request's query has been answered, RETRY until then."""
        if self._plan is not None:
            self._plan.prefill.looked_up(key, req_context.req_id)
        result = self._lookups.lookup(key, req_context)
        if result is None:
            self._asked = True
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Offer the step's stores to the planner; send its existence queries (one batch)."""
        if self._plan is not None:
            self._plan.prefill.flush()
            self._flush_stores()
            self._plan.prefill.scheduled(context.new_req_ids)
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Offload each request's chunks as vLLM computes them (its default policy)."""
        if self._plan is not None:
            self._plan.prefill.started(req_context.req_id)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop the request's lookup bookkeeping (queries in flight still finish)."""
        if self._plan is not None:
            self._plan.prefill.finished(req_context.req_id)
        self._lookups.cleanup(req_context.req_id)

    # -- transfers (the tier's threads) ---------------------------------------------------------

    def _indices(self, chunk_ids: Collection[int]) -> torch.Tensor:
        return torch.from_numpy(np.asarray(chunk_ids, dtype=np.int64))

    def _checked_keys(self, job: TransferJob) -> list[OffloadKey]:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys for {len(job.chunk_ids)} chunks")
        return keys

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's chunks from the primary tier on a write thread.

        With the planner, the job waits for the step's end, where the step's jobs are offered
        to it together (:meth:`_flush_stores`).
        """
        store = _Store(
            job_metadata.job_id, self._checked_keys(job_metadata), job_metadata.chunk_ids
        )
        with self._lock:
            self._jobs += 1
        if self._plan is None:
            self._write_later([store], None)
            return
        self._plan.prefill.stored(store.keys, job_metadata.req_context)
        self._stores.append(store)

    def _flush_stores(self) -> None:
        """Offer the step's store jobs to the planner in one call; write what it admits.

        One offer a step, not one a job: vLLM hands the jobs of a step's requests over at once,
        and the planner admits one call at a time while it measures a store's write rate, so
        jobs offered one by one would shed every request's chunks but the first's. A job with
        no chunk admitted is reported not stored at once; vLLM unpins its chunks at its next
        poll.
        """
        stores, self._stores = self._stores, []
        if not stores or self._plan is None:
            return
        plan = self._plan.offer([name for store in stores for name in self._keys(store.keys)])
        admitted = iter(plan.admitted)
        shed: list[int] = []
        writes: list[_Store] = []
        for store in stores:
            store.admitted = [next(admitted) for _ in store.keys]
            kept = sum(store.admitted)
            if kept < len(store.keys):
                shed.append(len(store.keys) - kept)
            if kept:
                writes.append(store)
            else:
                self._finished.put(
                    JobResult(
                        job_id=store.job_id, success=False, transfer_time=0.0, transfer_bytes=0
                    )
                )
        if isinstance(self._bp_detector, PlannerPressure):
            pressured = plan.pages == 0 and plan.rule != "admission"
            self._bp_detector.offered(plan.rule if pressured else None, shed)
        self._count(store_shed=sum(shed))
        self._ended(len(stores) - len(writes))
        if writes:
            self._write_later(writes, plan)

    def _write_later(self, stores: list[_Store], plan: WritePlan | None) -> None:
        with self._lock:
            self._busy += 1
        work = functools.partial(self._store, stores, plan)
        self._writers.submit(functools.partial(self._run, work, [s.job_id for s in stores]))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's chunks into the primary tier on a read thread."""
        keys = self._checked_keys(job_metadata)
        job_id, chunks = job_metadata.job_id, job_metadata.chunk_ids
        with self._lock:
            self._busy += 1
            self._jobs += 1
        if self._plan is not None:
            self._plan.queue_read(len(keys))
        work = functools.partial(self._load, job_id, keys, chunks)
        self._readers.submit(functools.partial(self._run, work, [job_id]))

    def _run(self, work: Callable[[], None], job_ids: list[int]) -> None:
        """Run jobs' work on a tier thread; whatever happens, vLLM hears that they ended."""
        try:
            work()
        except Exception:  # a bug, not a storage failure (the layers turn those into misses)
            logger.exception("HiCacheTier jobs %s failed", job_ids)
            for job_id in job_ids:
                self._finished.put(JobResult(job_id=job_id, success=False))
        finally:
            with self._lock:
                self._busy -= 1
            self._ended(len(job_ids))

    def _ended(self, jobs: int) -> None:
        """``jobs`` jobs have their results queued."""
        if not jobs:
            return
        with self._lock:
            self._jobs -= jobs
            if not self._jobs:
                self._drained.notify_all()
        self._progress.set()

    def _store(self, stores: list[_Store], plan: WritePlan | None) -> None:
        """Write the admitted chunks of ``stores`` in one call; report each job and the plan.

        Every result is queued after the call and the planner's report, so a bug before them
        leaves each job to :meth:`_run`'s failure report, never reported twice. The planner
        hears how the call ended whatever it raised: an unreported write would hold its ticket
        open, and the planner would shed every later write as if that one still ran. A call
        that raises something other than a storage failure counts its chunks failed and leaves
        the jobs to :meth:`_run`.
        """
        picks = [store.written() for store in stores]
        keys = [store.keys[i] for store, pick in zip(stores, picks, strict=True) for i in pick]
        rows = [store.chunks[i] for store, pick in zip(stores, picks, strict=True) for i in pick]
        stored = [False] * len(keys)
        start = time.perf_counter()
        try:
            stored = self.backend.batch_set_v1(self._keys(keys), self._indices(rows))
        except HiCacheError:
            logger.exception("HiCacheTier store jobs %s failed", [s.job_id for s in stores])
        except BaseException:
            self._count(store_failed=len(keys))
            raise
        finally:
            if plan is not None and self._plan is not None:
                self._plan.done(plan, sum(stored))
        elapsed = time.perf_counter() - start
        results = []
        outcomes = iter(stored)
        for store, pick in zip(stores, picks, strict=True):
            ok = sum(next(outcomes) for _ in pick)
            self._count(stored=ok, store_failed=len(pick) - ok)
            results.append(
                JobResult(
                    job_id=store.job_id,
                    success=ok == len(store.keys),
                    transfer_time=elapsed * len(pick) / max(len(keys), 1),
                    transfer_bytes=ok * self.block_size_bytes,
                )
            )
        for result in results:
            self._finished.put(result)

    def _load(self, job_id: int, keys: list[OffloadKey], chunks: Any) -> None:
        """Read the job's chunks; the planner gets the call's chunks delivered and seconds."""
        call = None if self._plan is None else self._plan.begin_read(len(keys))
        start = time.perf_counter()
        loaded = [False] * len(keys)
        try:
            loaded = self.backend.batch_get_v1(self._keys(keys), self._indices(chunks))
        except HiCacheError:
            logger.exception("HiCacheTier load job %d failed", job_id)
        finally:
            if call is not None and self._plan is not None:
                self._plan.end_read(call, sum(loaded))
        ok = sum(loaded)
        self._count(loaded=ok, load_failed=len(keys) - ok)
        failed = [key for key, hit in zip(keys, loaded, strict=True) if not hit]
        if failed:  # before the result: the poll that reports the job must see them as misses
            self._failed_loads.put(failed)
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

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call; a failed load's keys become misses."""
        self._yield_while_spinning()
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

    def _yield_while_spinning(self) -> None:
        """Give the tier's threads the GIL while vLLM's scheduler only waits for them.

        vLLM steps without pause while a transfer is in flight or a lookup is waiting for its
        query (this is called once per step). A step with nothing to run takes a fraction of a
        millisecond, so the scheduler thread holds the GIL almost always, and every time a tier
        thread comes back from a system call, or the lookup thread wakes for a query, it waits
        out the switch interval (5 ms): measured, 128 chunks took 936 ms to load instead of 9.
        When steps come faster than :data:`SPIN_S` and storage work is running or a lookup of
        the last step was answered RETRY, the scheduler waits up to :data:`SPIN_S` for it
        instead; a step that runs a forward takes longer than that and never waits.
        """
        now = time.monotonic()
        spinning = now - self._last_poll < SPIN_S
        waiting = self._busy or self._asked
        self._asked = False  # this step's lookups, which come next, say again
        if spinning and waiting and self._finished.empty():
            self._progress.wait(SPIN_S)
            self._progress.clear()
            now = time.monotonic()
        self._last_poll = now

    def has_pending_work(self) -> bool:
        """Whether a load or store is still running (vLLM keeps stepping to collect it)."""
        with self._lock:
            return bool(self._jobs) or not self._finished.empty()

    def drain_jobs(self) -> None:
        """Wait for every submitted job (each ends within the backend's timeouts)."""
        self._flush_stores()
        with self._lock:
            self._drained.wait_for(lambda: not self._jobs)

    def stats(self) -> dict[str, Any]:
        """Chunks loaded, stored, failed and shed, and the backend's own stats (hits, errors).

        With the planner, ``planner`` holds its decisions by rule (``fetch_pages``: chunks
        found and fetched or recomputed; ``write_pages``: written or shed) and its rates.
        """
        with self._lock:
            counts = dict(self._counts)
        backend = self._backend
        stats = {**counts, "backend": backend.stats() if backend else self._backend_stats}
        if self._plan is not None:
            stats["planner"] = self._plan.stats()
        return stats

    def shutdown(self) -> None:
        """Finish running jobs, stop the threads, close the backend; idempotent.

        The tier also lets go of the primary tier's memory, which vLLM unmaps next.
        """
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown()
        self._flush_stores()
        self._readers.stop()
        self._writers.stop()
        if self._prober is not None:
            self._prober.join()
        logger.info("HiCacheTier closing: %s", self.stats())
        self._backend_stats = self.backend.stats()
        self.backend.close()
        # The pool's tensor and the backend's registration export the primary tier's mmap;
        # vLLM cannot unmap it while any export is alive.
        self._backend = None
        del self._pool
        self._primary_kv_view = None
        gc.collect()
