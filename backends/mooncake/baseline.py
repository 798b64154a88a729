"""The raw yardstick ``hicache bench mooncake`` compares the backend with.

Plain ``MooncakeDistributedStore`` batch calls on the same store client, nothing on top:

* copying mode: the values are copied into one registered scratch buffer and stored with one
  ``batch_put_from``; reads are one ``batch_get_into`` into the scratch buffer, copied out. That
  is the least any client must do for memory Mooncake has not registered.
* zero-copy (v1) mode: one ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``
  on the host pool's own page buffers, exactly the addresses the backend hands Mooncake.

The gap between the backend and this is the cost of its checks, key mapping and bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_storage.backend import HostPool
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import BackendIOError, BatchMismatchError

from .client import SharedClient, acquire, code_name
from .config import MooncakeConfig

if TYPE_CHECKING:
    import torch

__all__ = ["RawMooncakeBaseline"]


class RawMooncakeBaseline:
    """Raw Mooncake batch calls under the backend's prefix, on its shared store client.

    Parameters
    ----------
    config
        The backend's options (the same store, the same client).
    deployment
        Unused; accepted so that every baseline is built like its backend.
    """

    def __init__(self, config: MooncakeConfig, deployment: Deployment | None = None) -> None:
        self.settings = config.resolve()
        self.client: SharedClient = acquire(self.settings)
        self.store: Any = self.client.store
        self.prefix = self.settings.prefix
        self.written: set[str] = set()
        self.scratch = np.zeros(0, dtype=np.uint8)
        self.scratch_ptr = 0
        self.pool: HostPool | None = None
        self.pool_ptr: int | None = None

    def _scratch(self, nbytes: int) -> int:
        if nbytes > self.scratch.nbytes:
            self._drop_scratch()
            self.scratch = np.zeros(nbytes, dtype=np.uint8)
            self.scratch_ptr = int(self.scratch.ctypes.data)
            self.client.retain(self.scratch_ptr, nbytes)
        return self.scratch_ptr

    def _drop_scratch(self) -> None:
        if self.scratch.nbytes:
            self.client.release(self.scratch_ptr)
            self.scratch = np.zeros(0, dtype=np.uint8)

    def _names(self, names: Sequence[str]) -> list[str]:
        prefix = self.prefix  # normalized: the backend's name is <prefix>/<key>
        return [f"{prefix}/{name}" for name in names] if prefix else list(names)

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Copy the values into the scratch buffer and store them with one ``batch_put_from``."""
        _check_lengths(names, values)
        views = [as_readable(value) for value in values]
        sizes = [view.nbytes for view in views]
        base = self._scratch(sum(sizes))
        ptrs = []
        offset = 0
        for view, size in zip(views, sizes, strict=True):
            self.scratch[offset : offset + size] = np.frombuffer(view, dtype=np.uint8)
            ptrs.append(base + offset)
            offset += size
        keys = self._names(names)
        self.written.update(keys)
        _expect(self.store.batch_put_from(keys, ptrs, sizes), (0,), "batch_put_from")

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Read the values with one ``batch_get_into`` into the scratch buffer and copy out."""
        _check_lengths(names, outs)
        views = [as_writable(out) for out in outs]
        sizes = [view.nbytes for view in views]
        base = self._scratch(sum(sizes))
        offsets = list(np.cumsum([0, *sizes[:-1]])) if sizes else []
        codes = self.store.batch_get_into(
            self._names(names), [base + int(o) for o in offsets], sizes
        )
        _expect(codes, None, "batch_get_into", sizes)
        for view, offset, size in zip(views, offsets, sizes, strict=True):
            np.frombuffer(view, dtype=np.uint8)[:] = self.scratch[int(offset) : int(offset) + size]

    # -- zero-copy (v1) mode ----------------------------------------------------------------------

    def register_host_pool(self, pool: HostPool) -> None:
        """Register the pool's tensor with the store (shared with the backend's registration)."""
        self._drop_pool()
        kv_buffer: Any = getattr(pool, "kv_buffer")  # noqa: B009 - HostKVPool attribute
        self.pool_ptr = int(kv_buffer.data_ptr())
        self.client.retain(self.pool_ptr, int(kv_buffer.numel() * kv_buffer.element_size()))
        self.pool = pool

    def _meta(self, host_indices: torch.Tensor | Sequence[int]) -> tuple[list[Any], list[Any]]:
        assert self.pool is not None, "register_host_pool first"
        meta = self.pool.page_buffer_meta(host_indices)
        return [[a for a, _ in page] for page in meta], [[n for _, n in page] for page in meta]

    def batch_write_v1(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> None:
        """Store each page from the pool's buffers with one ``batch_put_from_multi_buffers``."""
        ptrs, sizes = self._meta(host_indices)
        keys = self._names(names)
        self.written.update(keys)
        codes = self.store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        _expect(codes, (0,), "batch_put_from_multi_buffers")

    def batch_read_v1(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> None:
        """Load each page into the pool's buffers with one ``batch_get_into_multi_buffers``."""
        ptrs, sizes = self._meta(host_indices)
        codes = self.store.batch_get_into_multi_buffers(self._names(names), ptrs, sizes)
        _expect(codes, None, "batch_get_into_multi_buffers", [sum(s) for s in sizes])

    def _drop_pool(self) -> None:
        if self.pool_ptr is not None:
            self.client.release(self.pool_ptr)
            self.pool_ptr = None
            self.pool = None

    def close(self) -> None:
        """Remove what the baseline wrote and unregister its memory."""
        if self.written:
            self.store.batch_remove(sorted(self.written), True)
            self.written.clear()
        self._drop_scratch()
        self._drop_pool()


def _expect(
    codes: Sequence[int], ok: tuple[int, ...] | None, what: str, sizes: Sequence[int] = ()
) -> None:
    """Raise unless every code is in ``ok`` (or, with ``ok=None``, equals its size)."""
    expected = list(sizes) if ok is None else None
    for index, code in enumerate(codes):
        good = code == expected[index] if expected is not None else code in (ok or ())
        if not good:
            raise BackendIOError(
                f"raw mooncake {what} failed for item {index} with {code} ({code_name(code)})"
            )


def _check_lengths(names: Sequence[str], buffers: Sequence[memoryview]) -> None:
    if len(names) != len(buffers):
        raise BatchMismatchError(f"got {len(names)} names but {len(buffers)} buffers")
