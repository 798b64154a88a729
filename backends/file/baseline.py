"""The raw-disk yardstick the benchmark compares the file backend with.

It writes and reads the same bytes to the same disk with nothing on top: one plain
``open(..., "wb").write()`` per value (plus ``fsync`` when the backend is configured with it) and
one ``open(..., "rb").readinto()`` per read (looping on short reads), in a flat
``<root>/.raw-baseline/`` directory, with as many values in flight as the backend moves pages
(its ``io_threads``). No temporary file, no atomic publish, no index, no fan-out, no integrity
record: the gap between the two is the cost of the backend's guarantees.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache_storage.backend import HostPool
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import BatchMismatchError, BufferSizeError, PoolNotRegisteredError
from hicache_storage.keys.validation import validate_key
from hicache_storage.kit import IOWorkers, flat, read_into, write_from

from .backend import BASELINE_DIR
from .config import FileConfig

if TYPE_CHECKING:
    import torch

__all__ = ["RawDiskBaseline"]


class RawDiskBaseline:
    """Plain file writes and reads under ``<root>/.raw-baseline/``, values or host-pool pages.

    Parameters
    ----------
    config
        The file backend's settings: ``root`` and ``fsync`` are used.
    deployment
        Unused; accepted so that every baseline is built like its backend.
    """

    def __init__(self, config: FileConfig, deployment: Deployment | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(config.root))
        self.directory = os.path.join(root, BASELINE_DIR)
        self.fsync = config.fsync
        self._io = IOWorkers(config.threads, "hicache-file-baseline")
        self._pool: HostPool | None = None
        os.makedirs(self.directory, exist_ok=True)

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Write each value to its own file, replacing any earlier one."""
        _check_lengths(names, values)
        self._io.map(self._write_one, list(zip(names, values, strict=True)))

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Read each file into its output buffer.

        Raises
        ------
        BufferSizeError
            If a file is shorter than its output buffer.
        """
        _check_lengths(names, outs)
        self._io.map(self._read_one, list(zip(names, outs, strict=True)))

    def register_host_pool(self, pool: HostPool) -> None:
        """Take the pool whose pages :meth:`batch_write_v1` and :meth:`batch_read_v1` move."""
        self._pool = pool

    def batch_write_v1(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> None:
        """Write each page's buffers to its own file with one ``pwritev``, pages in parallel."""
        pages = self._page_views(names, host_indices)
        self._io.map(self._write_page, list(zip(names, pages, strict=True)))

    def batch_read_v1(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> None:
        """Read each page's file into its buffers with one ``preadv``, pages in parallel.

        Raises
        ------
        BufferSizeError
            If a file is shorter than its page.
        """
        pages = self._page_views(names, host_indices)
        self._io.map(self._read_page, list(zip(names, pages, strict=True)))

    def close(self) -> None:
        """Stop the I/O threads and remove the baseline's scratch directory."""
        self._io.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _write_one(self, item: tuple[str, memoryview]) -> None:
        name, value = item
        data = as_readable(value)
        with open(self._path(name), "wb", buffering=0) as f:
            written = 0
            while written < data.nbytes:
                n = f.write(data[written:])
                if not n:
                    raise OSError(errno.EIO, f"baseline write of {name!r} made no progress")
                written += n
            if self.fsync:
                os.fsync(f.fileno())

    def _read_one(self, item: tuple[str, memoryview]) -> None:
        name, out = item
        view = as_writable(out)
        with open(self._path(name), "rb", buffering=0) as f:
            got = 0
            while got < view.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        if got != view.nbytes:
            raise BufferSizeError(f"baseline file {name!r} holds {got} bytes, not {view.nbytes}")

    def _page_views(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[list[memoryview]]:
        if self._pool is None:
            raise PoolNotRegisteredError("call register_host_pool before the baseline's v1 calls")
        pages = self._pool.page_buffer_views(host_indices)
        if len(pages) != len(names):
            raise BatchMismatchError(f"got {len(names)} names but {len(pages)} pages")
        return [[flat(view) for view in views] for views in pages]

    def _write_page(self, item: tuple[str, list[memoryview]]) -> None:
        name, views = item
        fd = os.open(self._path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_from(fd, views)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _read_page(self, item: tuple[str, list[memoryview]]) -> None:
        name, views = item
        fd = os.open(self._path(name), os.O_RDONLY)
        try:
            got = read_into(fd, views)
        finally:
            os.close(fd)
        want = sum(view.nbytes for view in views)
        if got != want:
            raise BufferSizeError(f"baseline file {name!r} holds {got} bytes, not {want}")

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, validate_key(name))


def _check_lengths(names: Sequence[str], buffers: Sequence[memoryview]) -> None:
    if len(names) != len(buffers):
        raise BatchMismatchError(f"got {len(names)} names but {len(buffers)} buffers")
