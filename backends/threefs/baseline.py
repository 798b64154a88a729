"""The raw yardstick ``hicache bench 3fs`` compares the backend with.

Plain ``os.pwrite`` / ``os.preadv`` of the same bytes into the *same data file* the backend uses
(its first file), in a sparse scratch region past the slots and their integrity records
(``stored_file_size`` onwards, so the backend never sees it) as large as the backend's capacity,
one call per value at slot-aligned offsets, spread over the same number of threads as the
backend's ``io_threads``. No metadata, no reservation, no validation: the gap between the two is
the cost of the backend's bookkeeping.
``close`` truncates the file back to ``stored_file_size``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
from collections.abc import Callable, Sequence

from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import BatchMismatchError, BufferSizeError

from .backend import namespace_of
from .config import ThreeFSConfig

__all__ = ["RawFileBaseline"]


class RawFileBaseline:
    """Raw positional writes and reads in a scratch region of the backend's first data file.

    Parameters
    ----------
    config
        The backend's settings: ``path``, ``file_prefix``/``ownership`` (to find the file),
        ``file_size``, ``slot_bytes`` and ``io_threads`` are used.
    deployment
        The rank whose namespace names the file.
    """

    def __init__(self, config: ThreeFSConfig, deployment: Deployment | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(config.path))
        namespace = namespace_of(config, deployment or Deployment())
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, f"{namespace}.0.bin")
        self.base = config.stored_file_size
        self.region = config.file_size * config.file_count
        self.slot = config.slot_bytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size < self.base + self.region:
            os.ftruncate(self.fd, self.base + self.region)  # sparse, like the backend's files
        self._offsets: dict[str, int] = {}
        self._next = 0
        self._threads = config.io_threads
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, config.io_threads - 1))

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Write each value at its own slot-aligned offset of the scratch region."""
        _check_lengths(names, values)
        jobs = [
            (self._place(name, as_readable(v).nbytes), as_readable(v))
            for name, v in zip(names, values, strict=True)
        ]
        self._spread(jobs, self._write)

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Read each value back into its output buffer.

        Raises
        ------
        BufferSizeError
            If the file ends before a value does.
        """
        _check_lengths(names, outs)
        jobs = [
            (self._offsets[name], as_writable(out)) for name, out in zip(names, outs, strict=True)
        ]
        self._spread(jobs, self._read)

    def close(self) -> None:
        """Stop the threads and give the scratch region back (truncate to ``stored_file_size``)."""
        self._pool.shutdown(wait=True)
        try:
            if os.fstat(self.fd).st_size > self.base:
                os.ftruncate(self.fd, self.base)
        finally:
            os.close(self.fd)

    def _place(self, name: str, nbytes: int) -> int:
        stride = -(-max(nbytes, 1) // self.slot) * self.slot
        if self._next + stride > self.region:
            self._next = 0
        offset = self.base + self._next
        self._next += stride
        self._offsets[name] = offset
        return offset

    def _spread(
        self,
        jobs: list[tuple[int, memoryview]],
        run: Callable[[list[tuple[int, memoryview]]], None],
    ) -> None:
        workers = min(self._threads, len(jobs))
        if workers <= 1:
            run(jobs)
            return
        parts = [jobs[i::workers] for i in range(workers)]
        futures = [self._pool.submit(run, part) for part in parts[1:]]
        run(parts[0])
        for future in futures:
            future.result()

    def _write(self, jobs: list[tuple[int, memoryview]]) -> None:
        for offset, view in jobs:
            done = 0
            while done < view.nbytes:
                n = os.pwrite(self.fd, view[done:], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "baseline write made no progress")
                done += n

    def _read(self, jobs: list[tuple[int, memoryview]]) -> None:
        for offset, view in jobs:
            done = 0
            while done < view.nbytes:
                n = os.preadv(self.fd, [view[done:]], offset + done)
                if n <= 0:
                    raise BufferSizeError(f"baseline region ends at {offset + done}")
                done += n


def _check_lengths(names: Sequence[str], buffers: Sequence[memoryview]) -> None:
    if len(names) != len(buffers):
        raise BatchMismatchError(f"got {len(names)} names but {len(buffers)} buffers")
