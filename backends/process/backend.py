"""The ``process`` backend: another backend run in a storage process of its own.

An engine's storage threads share one interpreter, and so one GIL, with the thread that drives
the model: each page a read thread moves costs it a few trips for the GIL, which it waits for
while the scheduler launches kernels (measured on an H200: 2.4 to 4.8 ms per 8 MiB page inside the
engine against 0.2 ms for the same backend alone). This backend builds the backend it is given
in a storage process of its own (forked by :mod:`~hicache_storage.backends.process.launcher`)
and forwards every call over a socket; the v1 calls carry only keys and page
indices, because the child maps the engine's host pool (allocated with ``shared=True``, see
:mod:`hicache_storage.hostpool.shared`) and moves the pages there itself. One call costs the
engine a message each way, whatever the pages cost the child.

Failures keep their types: the child's typed errors are raised here, a lost child is
:class:`~hicache_storage.errors.BackendUnavailableError` and a call unanswered within
``call_timeout_s`` is :class:`~hicache_storage.errors.BackendTimeoutError`, which the degrade
layer counts as misses. A call that times out kills its storage process before it returns (see
:mod:`~hicache_storage.backends.process.session`): the child works in the caller's pages, and
a call must never be served after the caller was answered. A lost storage process (killed so,
crashed, OOM-killed) is replaced in the background, with backoff, and the host pool registered
again; until then calls fail at once. The child exits when this backend closes or its parent dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from typing_extensions import Buffer

from hicache_storage.backend import HostPool, StorageBackend, copy_into
from hicache_storage.buffers import as_readable
from hicache_storage.config import Deployment, convert, read_source
from hicache_storage.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    HiCacheError,
    HostPoolError,
)
from hicache_storage.hostpool import HostKVPool, UnifiedObjectPool
from hicache_storage.hostpool.shared import region_of
from hicache_storage.kit import closed_guard
from hicache_storage.registry import get_spec

from .config import ProcessConfig
from .protocol import PoolDescription, Start
from .session import StorageProcess

__all__ = ["ProcessBackend", "ProcessConfig"]

logger = logging.getLogger(__name__)


@closed_guard
class ProcessBackend(StorageBackend):
    """Serve ``config.backend`` from a child process; pages move through shared memory."""

    name = "process"

    def __init__(self, config: ProcessConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        spec = get_spec(config.backend)
        options = convert(
            read_source(config.options), spec.load_config_type(), f"{spec.name} backend options"
        )
        self._config = config
        self._served = spec.name
        self._start = Start(spec.name, options, deployment or Deployment(), config.threads)
        self._lock = threading.Lock()
        self._pool: PoolDescription | None = None
        self._restarts = 0
        self._lost: str | None = None
        self._respawning: threading.Thread | None = None
        self._retry_at = 0.0
        self._backoff_s = 0.0
        self._closing = False
        self._process = StorageProcess(self._start, config.start_timeout_s, self._on_lost)
        self.capabilities = dataclasses.replace(self._process.capabilities, shared_host_pool=True)

    # -- the contract, forwarded ------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value the storage process read, or copy it into ``out``."""
        value: bytes | None = self._call("get", key)
        if value is None or out is None:
            return value
        return copy_into(value, out)

    def exists(self, key: str) -> bool:
        """Return whether the served backend holds ``key``."""
        found: bool = self._call("exists", key)
        return found

    def set(self, key: str, value: Buffer) -> bool:
        """Store a copy of ``value`` through the storage process."""
        stored: bool = self._call("set", key, bytes(as_readable(value)))
        return stored

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read every key in the storage process and copy the hits into ``outs``."""
        sizes = [memoryview(out).nbytes for out in outs]
        values: list[bytes | None] = self._call("batch_get", list(keys), sizes)
        hits = []
        for value, out in zip(values, outs, strict=True):
            if value is not None:
                copy_into(value, out)
            hits.append(value is not None)
        return hits

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store every value through the storage process."""
        data = [bytes(as_readable(value)) for value in values]
        stored: list[bool] = self._call("batch_set", list(keys), data)
        return stored

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the served backend's leading-hit count."""
        count: int = self._call("batch_exists", list(keys))
        return count

    def register_host_pool(self, pool: HostPool) -> None:
        """Register ``pool`` here and its shared-memory twin in the storage process.

        Raises
        ------
        HostPoolError
            If the pool is not a host pool of this SDK allocated with ``shared=True``.
        """
        description = _describe(pool)
        super().register_host_pool(pool)
        self._pool = description  # a new storage process registers it again
        # With no storage process now, the one that replaces it registers the pool.
        with contextlib.suppress(BackendUnavailableError, BackendTimeoutError):
            self._call("register_host_pool", description)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Have the storage process read each key's object into its page of the shared pool."""
        hits: list[bool] = self._call("batch_get_v1", list(keys), _indices(host_indices))
        return hits

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Have the storage process write each key's page of the shared pool."""
        stored: list[bool] = self._call("batch_set_v1", list(keys), _indices(host_indices))
        return stored

    def delete(self, key: str) -> bool:
        """Delete ``key`` in the served backend."""
        deleted: bool = self._call("delete", key)
        return deleted

    def clear(self) -> None:
        """Clear the served backend."""
        self._call("clear")

    def stats(self) -> dict[str, Any]:
        """Return the served backend's stats, with this process's view under ``process``."""
        process = self._process
        served: dict[str, Any] = {}
        if process.lost is None and not self.closed:
            try:
                served = process.call("stats", (), self._config.call_timeout_s)
            except (BackendUnavailableError, BackendTimeoutError):
                served = {}
        return {
            **served,
            "process": {
                "backend": self._served,
                "pid": process.pid,
                "running": process.lost is None,
                "restarts": self._restarts,
                "lost": self._lost,
            },
        }

    def _close(self) -> None:
        with self._lock:
            self._closing = True
        self._process.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<ProcessBackend serving {self._served!r} in process {self._process.pid}{state}>"

    # -- the wire and the storage process's lifetime ---------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        process = self._process
        if process.lost is not None:
            self._respawn_soon()
            raise BackendUnavailableError(f"{process.lost}; a new storage process is starting")
        return process.call(method, args, self._config.call_timeout_s)

    def _on_lost(self, reason: str) -> None:
        """Log the dead storage process and start a new one (unless closing)."""
        self._lost = reason
        if not self._closing:
            logger.warning("%s (serving %s); starting a new one", reason, self._served)
            self._respawn_soon()

    def _respawn_soon(self) -> None:
        """Start a new storage process in the background, at most one at a time, with backoff."""
        with self._lock:
            busy = self._respawning is not None and self._respawning.is_alive()
            if self._closing or busy or time.monotonic() < self._retry_at:
                return
            self._respawning = threading.Thread(
                target=self._respawn, name="hicache-process-respawn", daemon=True
            )
            self._respawning.start()

    def _respawn(self) -> None:
        process: StorageProcess | None = None
        try:
            process = StorageProcess(self._start, self._config.start_timeout_s, self._on_lost)
            if self._pool is not None:
                process.call("register_host_pool", (self._pool,), self._config.call_timeout_s)
        except HiCacheError as exc:
            if process is not None:
                process.close()
            with self._lock:
                self._backoff_s = min(max(2 * self._backoff_s, _RETRY_FIRST_S), _RETRY_MAX_S)
                self._retry_at = time.monotonic() + self._backoff_s
            logger.warning(
                "a new storage process for %s failed to start (%s); next try in %.0f s",
                self._served,
                exc,
                self._backoff_s,
            )
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self._process = process
                self._restarts += 1
                self._backoff_s = 0.0
        if closing:
            process.close()
        else:
            logger.warning("storage process %d now serves %s", process.pid, self._served)


_RETRY_FIRST_S = 1.0
"""Wait before starting a storage process again after a start failed (the first loss restarts at
once: a crash is usually one call's)."""

_RETRY_MAX_S = 60.0
"""Longest wait between starts, so a storage process that cannot start costs one fork a minute."""


def _indices(host_indices: torch.Tensor | Sequence[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    if isinstance(host_indices, torch.Tensor):
        return host_indices.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(host_indices, dtype=np.int64)


def _describe(pool: HostPool) -> PoolDescription:
    """Say how the storage process finds ``pool``'s pages in shared memory."""
    plan = None
    kv = pool
    if isinstance(pool, UnifiedObjectPool):
        plan, kv = pool.plan, pool.pool
    if not isinstance(kv, HostKVPool):
        raise HostPoolError(
            f"the process backend needs a host pool of this SDK (MHAHostPool or MLAHostPool), "
            f"got {type(kv).__name__}"
        )
    region = region_of(kv.kv_buffer)
    if region is None:
        raise HostPoolError(
            "the process backend's storage process moves pages in place, so the host pool must "
            "be in shared memory: build it with shared=True (e.g. MHAHostPool(..., shared=True))"
        )
    return PoolDescription(
        type(kv),
        region,
        tuple(kv.kv_buffer.shape),
        kv.kv_buffer.dtype,
        kv.page_size,
        kv.layout,
        plan,
    )
