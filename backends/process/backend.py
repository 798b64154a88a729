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
layer counts as misses. The child exits when this backend closes or its parent dies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
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
    HostPoolError,
)
from hicache_storage.hostpool import HostKVPool, UnifiedObjectPool
from hicache_storage.hostpool.shared import region_of
from hicache_storage.kit import closed_guard
from hicache_storage.registry import get_spec

from .config import ProcessConfig
from .launcher import launcher
from .protocol import PoolDescription, Reply, Request, Start

__all__ = ["ProcessBackend", "ProcessConfig"]


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
        self._pending: dict[int, concurrent.futures.Future[Reply]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._lost: str | None = None
        ours, self._pid = launcher().launch(config.start_timeout_s)
        self._conn = Connection(ours.detach())
        self._conn.send(Start(spec.name, options, deployment or Deployment(), config.threads))
        started = self._conn.poll(config.start_timeout_s)
        reply: Reply | None = self._conn.recv() if started else None
        if reply is None or not reply.ok:
            self._stop(kill=True)
            if reply is None:
                raise BackendUnavailableError(
                    f"the storage process did not start within {config.start_timeout_s} s"
                )
            raise reply.value
        inner = reply.value
        self.capabilities = dataclasses.replace(inner, shared_host_pool=True)
        self._reader = threading.Thread(
            target=self._read_replies, name="hicache-process-replies", daemon=True
        )
        self._reader.start()

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
        served: dict[str, Any] = {}
        if self._lost is None and not self.closed:
            try:
                served = self._call("stats")
            except (BackendUnavailableError, BackendTimeoutError):
                served = {}
        return {
            **served,
            "process": {
                "backend": self._served,
                "pid": self._pid,
                "running": self._lost is None and _alive(self._pid),
                "lost": self._lost,
            },
        }

    def _close(self) -> None:
        self._stop(kill=False)

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<ProcessBackend serving {self._served!r} in process {self._pid}{state}>"

    # -- the wire ---------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        if self._lost is not None:
            raise BackendUnavailableError(self._lost)
        future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        with self._send_lock:
            call_id = next(self._ids)
            self._pending[call_id] = future
            try:
                self._conn.send(Request(call_id, method, args))
            except (OSError, ValueError) as exc:
                self._pending.pop(call_id, None)
                raise BackendUnavailableError(f"the storage process is gone: {exc}") from exc
        try:
            reply = future.result(self._config.call_timeout_s)
        except concurrent.futures.TimeoutError:
            self._pending.pop(call_id, None)
            raise BackendTimeoutError(
                f"the storage process did not answer {method} within "
                f"{self._config.call_timeout_s} s"
            ) from None
        if not reply.ok:
            raise reply.value
        return reply.value

    def _read_replies(self) -> None:
        """Hand each reply to its waiting call; fail every waiting call once the child is lost."""
        while True:
            try:
                reply: Reply = self._conn.recv()
            except (EOFError, OSError):
                break
            future = self._pending.pop(reply.call_id, None)
            if future is not None:
                future.set_result(reply)
        self._lost = f"the storage process {self._pid} exited"
        for call_id in list(self._pending):
            future = self._pending.pop(call_id, None)
            if future is not None:
                future.set_exception(BackendUnavailableError(self._lost))

    def _stop(self, *, kill: bool) -> None:
        """Ask the storage process to exit (kill it if it will not) and close the socket."""
        if not kill:
            try:
                with self._send_lock:
                    self._conn.send(None)
            except (OSError, ValueError):
                kill = True
        reader = getattr(self, "_reader", None)
        if not kill and reader is not None:
            reader.join(_EXIT_S)  # the reader sees the socket close when the process exits
            kill = reader.is_alive()
        if kill and _alive(self._pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
        self._conn.close()


_EXIT_S = 10.0
"""How long ``close`` waits for the storage process to finish its calls and exit."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
