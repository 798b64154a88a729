"""The storage process: builds the served backend and answers the process backend's calls.

Forked by the launcher (:mod:`~hicache_storage.backends.process.launcher`) for each
:class:`~hicache_storage.backends.process.ProcessBackend`, with its end of a socket pair.
Calls run on ``threads`` threads of this process, so they overlap as they would in the engine,
but compete for this interpreter's GIL only with each other. It exits on a ``None`` message or
when the socket closes (the engine exited).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pickle
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from hicache_storage import registry
from hicache_storage.backend import StorageBackend
from hicache_storage.errors import BackendError
from hicache_storage.hostpool import UnifiedObjectPool
from hicache_storage.hostpool.shared import map_region
from hicache_storage.registry import get_spec

from .launcher import serve_launches
from .protocol import PoolDescription, Reply, Request, Start

__all__ = ["main"]


class _Server:
    """Runs each request on the served backend and sends its reply."""

    def __init__(self, conn: Connection, backend: StorageBackend) -> None:
        self.conn = conn
        self.backend = backend
        self.send_lock = threading.Lock()
        self.methods: dict[str, Callable[..., Any]] = {
            "get": backend.get,
            "exists": backend.exists,
            "set": backend.set,
            "batch_get": self.batch_get,
            "batch_set": backend.batch_set,
            "batch_exists": backend.batch_exists,
            "register_host_pool": self.register_host_pool,
            "batch_get_v1": self.batch_get_v1,
            "batch_set_v1": self.batch_set_v1,
            "delete": backend.delete,
            "clear": backend.clear,
            "stats": backend.stats,
        }

    def serve(self, request: Request) -> None:
        try:
            reply = Reply(request.call_id, True, self.methods[request.method](*request.args))
        except Exception as exc:  # noqa: BLE001 - every error goes back to the caller, typed
            reply = Reply(request.call_id, False, _portable(exc))
        # The engine may be gone: then the receive loop ends too.
        with self.send_lock, contextlib.suppress(OSError, ValueError):
            self.conn.send(reply)

    def batch_get(self, keys: list[str], sizes: list[int]) -> list[bytes | None]:
        outs = [bytearray(size) for size in sizes]
        hits = self.backend.batch_get(keys, outs)
        return [bytes(out) if hit else None for hit, out in zip(hits, outs, strict=True)]

    def register_host_pool(self, pool: PoolDescription) -> None:
        nbytes = pool.dtype.itemsize
        for length in pool.shape:
            nbytes *= length
        tensor = map_region(pool.region)[:nbytes].view(pool.dtype).view(pool.shape)
        host = pool.kind.from_buffer(tensor, pool.page_size, pool.layout)
        self.backend.register_host_pool(
            host if pool.plan is None else UnifiedObjectPool(host, pool.plan)
        )

    def batch_get_v1(self, keys: list[str], host_indices: Any) -> list[bool]:
        return self.backend.batch_get_v1(keys, torch.from_numpy(host_indices))

    def batch_set_v1(self, keys: list[str], host_indices: Any) -> list[bool]:
        return self.backend.batch_set_v1(keys, torch.from_numpy(host_indices))


def _portable(exc: Exception) -> Exception:
    """Return ``exc`` if it survives pickling, else a :class:`BackendError` saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any pickling failure means "send a description"
        return BackendError(f"{type(exc).__name__}: {exc}")
    return exc


def serve(fd: int) -> None:
    """Build the backend the first message names and answer calls on socket ``fd`` until told."""
    conn = Connection(fd)
    start: Start = conn.recv()
    try:
        backend = get_spec(start.backend).build(start.options, start.deployment)
    except Exception as exc:  # noqa: BLE001 - the engine raises it
        conn.send(Reply(-1, False, _portable(exc)))
        conn.close()
        return
    conn.send(Reply(-1, True, backend.capabilities))
    server = _Server(conn, backend)
    with concurrent.futures.ThreadPoolExecutor(start.threads, "hicache-storage") as calls:
        while True:
            try:
                request: Request | None = conn.recv()
            except (EOFError, OSError):
                break
            if request is None:
                break
            calls.submit(server.serve, request)
    backend.close()
    conn.close()


def main(argv: list[str] | None = None) -> None:
    """``--launcher FD``: fork a storage process per socket sent on FD; ``FD``: serve one."""
    args = sys.argv[1:] if argv is None else argv
    if args[0] == "--launcher":
        registry.registered_backends()  # load every plugin once, before forking
        serve_launches(int(args[1]), serve)
    else:
        serve(int(args[0]))


if __name__ == "__main__":
    main()
