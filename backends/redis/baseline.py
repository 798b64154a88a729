"""The raw redis-py yardstick the benchmark compares the Redis backend with.

The same server, login and timeouts, through redis-py as most code calls it: one non-transactional
pipeline per batch holding a plain ``SET`` (no ``NX``) or ``GET`` per key, with redis-py's default
(hiredis) command packer, and each reply copied into its output buffer. No chunking, no first-wins
check, no key prefix check, no layers: the gap is the cost of the backend's guarantees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import redis.exceptions as rx

from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import BatchMismatchError, BufferSizeError
from hicache_storage.keys.validation import validate_key

from .backend import connect
from .config import RedisConfig

__all__ = ["RawRedisBaseline"]


class RawRedisBaseline:
    """Pipelined ``SET``/``GET`` of ``<namespace>:raw-baseline:<name>`` with plain redis-py.

    Parameters
    ----------
    config
        The Redis backend's settings: the server, login, TLS, timeouts and prefix are used.
    deployment
        Unused; accepted so that every baseline is built like its backend.
    """

    def __init__(self, config: RedisConfig, deployment: Deployment | None = None) -> None:
        self.prefix = f"{config.namespace}:raw-baseline:".encode("ascii")
        self.client: Any = connect(config, pass_through=False)
        self.written: set[bytes] = set()

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Set each name to its value in one pipeline, replacing any earlier value."""
        _check_lengths(names, values)
        pipe = self.client.pipeline(transaction=False)
        for name, value in zip(names, values, strict=True):
            key = self._key(name)
            pipe.set(key, as_readable(value))
            self.written.add(key)
        pipe.execute()

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Get every name in one pipeline and copy each value into its output buffer.

        Raises
        ------
        BufferSizeError
            If a value is missing or its size differs from its output buffer.
        """
        _check_lengths(names, outs)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(self._key(name))
        for name, out, data in zip(names, outs, pipe.execute(), strict=True):
            view = as_writable(out)
            if data is None or len(data) != view.nbytes:
                got = "nothing" if data is None else f"{len(data)} bytes"
                raise BufferSizeError(f"baseline key {name!r} holds {got}, not {view.nbytes}")
            view[:] = data

    def close(self) -> None:
        """Remove what the baseline wrote and close its connections."""
        try:
            keys = sorted(self.written)
            for start in range(0, len(keys), 256):
                pipe = self.client.pipeline(transaction=False)
                for key in keys[start : start + 256]:
                    pipe.unlink(key)
                pipe.execute()
            self.written.clear()
        finally:
            with contextlib.suppress(rx.RedisError, OSError):
                self.client.close()
                pool = getattr(self.client, "connection_pool", None)
                if pool is not None:
                    pool.disconnect()

    def _key(self, name: str) -> bytes:
        return self.prefix + validate_key(name).encode("ascii")


def _check_lengths(names: Sequence[str], buffers: Sequence[memoryview]) -> None:
    if len(names) != len(buffers):
        raise BatchMismatchError(f"got {len(names)} names but {len(buffers)} buffers")
