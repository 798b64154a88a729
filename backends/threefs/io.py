"""Moving bytes between host buffers and slots of the data files: one small interface, two engines.

:class:`SlotIO` takes batches of :class:`IORequest` (a file, an offset and the buffers whose bytes
lie back to back at that offset) and reads or writes them all, raising :class:`OSError` when any
request fails or comes up short. Requests are spread over ``io_threads`` worker threads.

:class:`PosixIO`
    ``os.preadv`` / ``os.pwritev`` straight into and out of the caller's buffers: no copy on any
    filesystem, a 3FS FUSE mount included.
:class:`UsrbioIO`
    3FS's user-space ring I/O (``hf3fs_fuse.io``): each worker thread owns a read ring, a write
    ring and a shared-memory iovec registered with the mount; requests are staged through that
    iovec (one ``memcpy``), prepared on the ring, submitted together and waited for. It is chosen
    only when the module imports *and* the path is on a 3FS mount. No 3FS cluster can run where
    this project is tested, so this engine is exercised against a fake of the module's interface
    (``tests/backends/threefs/fake_usrbio.py``), never against a real mount.

:func:`open_io` creates the data files (sparse, ``ftruncate`` to their size) and picks the engine.
A data file's path that holds anything but a regular file (a FIFO, a directory, a device) is
cleared and the file created in its place (:func:`open_file`): nothing was ever stored there.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import errno
import importlib
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, NamedTuple

from hicache_storage.errors import ConfigError, MissingDependencyError
from hicache_storage.kit import clear_entry, open_regular
from hicache_storage.kit.guard import DRAIN_S, CallGate
from hicache_storage.kit.pageio import read_runs, write_runs
from hicache_storage.kit.parallel import IOWorkers
from hicache_storage.kit.vectored import read_into, write_from

__all__ = [
    "HF3FS_SUPER_MAGIC",
    "IORequest",
    "PosixIO",
    "SlotIO",
    "UsrbioIO",
    "find_3fs_mount",
    "load_usrbio",
    "open_file",
    "open_io",
]

HF3FS_SUPER_MAGIC = 0x8F3F5FFF
"""``statfs.f_type`` of a 3FS FUSE mount."""

USRBIO_MODULE = "hf3fs_fuse.io"

_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


def open_file(path: str, mode: int = 0o644) -> int:
    """Open ``path`` for reading and writing, creating it; return its descriptor.

    Only a regular file is used: the open never waits
    (:func:`~hicache_storage.kit.open_regular`), and any other entry at ``path`` (a FIFO, a
    directory, a socket, a device, a symlink to one) is cleared
    (:func:`~hicache_storage.kit.clear_entry`) and the file created in its place. No byte could
    have been stored in such an entry, so none is lost, and the store opens instead of failing
    until someone removes the entry by hand.

    Raises
    ------
    OSError
        If the file cannot be created, or ``path`` still holds no regular file once cleared.
    """
    for _ in range(2):
        fd = open_regular(path, _FLAGS, mode)
        if fd is not None:
            return fd
        clear_entry(path)
    raise OSError(errno.EEXIST, f"{path} is not a regular file and was not replaced", path)


class IORequest(NamedTuple):
    """One contiguous range of a data file and the buffers that map onto it, in order."""

    file: int
    offset: int
    buffers: list[memoryview]

    @property
    def nbytes(self) -> int:
        """Bytes the request moves."""
        return sum(buffer.nbytes for buffer in self.buffers)


def _chunks(buffers: Sequence[memoryview], limit: int) -> list[list[memoryview]]:
    """Cut ``buffers`` into groups of at most ``limit`` bytes, slicing where needed."""
    groups: list[list[memoryview]] = [[]]
    room = limit
    for buffer in buffers:
        view = buffer
        while view.nbytes:
            if not room:
                groups.append([])
                room = limit
            piece = view[:room]
            groups[-1].append(piece)
            room -= piece.nbytes
            view = view[piece.nbytes :]
    return [group for group in groups if group]


class SlotIO(abc.ABC):
    """Reads and writes batches of requests against a fixed set of data files.

    Parameters
    ----------
    paths
        The data files, created if absent and extended (sparsely) to ``file_size``.
    file_size
        Bytes each file must hold.
    io_threads
        Worker threads a batch is spread over; 1 runs every request in the caller's thread.

    Every batch runs inside a :class:`~hicache_storage.kit.CallGate`: :meth:`close` refuses
    new batches (``BackendClosedError``) and closes the files only once the running ones are
    done, so no read or write ever reaches a closed, or reused, descriptor.
    """

    kind: str = ""

    def __init__(self, paths: Sequence[str], file_size: int, io_threads: int) -> None:
        self.paths = list(paths)
        self.fds: list[int] = []
        self._threads = io_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._gate = CallGate(f"3fs {self.kind} I/O")
        try:
            for path in self.paths:
                fd = open_file(path)
                self.fds.append(fd)
                if os.fstat(fd).st_size < file_size:
                    os.ftruncate(fd, file_size)
        except BaseException:
            self._close_fds()
            raise

    def read(self, requests: Sequence[IORequest]) -> None:
        """Fill every request's buffers from its file range.

        Raises
        ------
        OSError
            If a read fails or the file ends first.
        BackendClosedError
            After :meth:`close`.
        """
        with self._gate.inside():
            self._run(requests, self._read_batch)

    def read_checked(
        self, runs: Sequence[Sequence[IORequest]], checked: Sequence[int]
    ) -> list[int] | None:
        """Read each run (one value's ranges, in order); return each run's CRC32C, or None.

        The CRC32C covers a run's first ``checked[i]`` bytes, computed while they arrive. None
        when this I/O cannot checksum as it reads (the caller reads with :meth:`read` and
        checksums after).

        Raises
        ------
        OSError
            If a read fails or a file ends first.
        BackendClosedError
            After :meth:`close`.
        """
        return None

    def write_checked(self, runs: Sequence[Sequence[IORequest]]) -> list[int] | None:
        """Write each run (one value's ranges, in order); return each run's CRC32C, or None.

        The CRC32C of a run's bytes is computed as they are written, for the value's integrity
        record: no pass over the value before the write. None when this I/O cannot checksum as
        it writes (the caller seals the values first and writes with :meth:`write`).

        Raises
        ------
        OSError
            If a write fails.
        BackendClosedError
            After :meth:`close`.
        """
        return None

    def write(self, requests: Sequence[IORequest]) -> None:
        """Write every request's buffers to its file range.

        Raises
        ------
        OSError
            If a write fails.
        BackendClosedError
            After :meth:`close`.
        """
        with self._gate.inside():
            self._run(requests, self._write_batch)

    def sync(self, files: Sequence[int]) -> None:
        """Flush the named files' data to stable storage.

        Raises
        ------
        BackendClosedError
            After :meth:`close`.
        """
        with self._gate.inside():
            self._sync(sorted(set(files)))

    def close(self) -> None:
        """Refuse new batches; once the running ones are done, stop the workers, close the files."""
        self._gate.shut(self._release, DRAIN_S)

    def _sync(self, files: Sequence[int]) -> None:
        for file in files:
            os.fsync(self.fds[file])

    def _release(self) -> None:
        """Stop the worker threads and close the files (no batch is running)."""
        self._stop_pool()
        self._close_fds()

    def _stop_pool(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @abc.abstractmethod
    def _read_batch(self, requests: Sequence[IORequest]) -> None:
        """Read ``requests`` in the calling thread."""

    @abc.abstractmethod
    def _write_batch(self, requests: Sequence[IORequest]) -> None:
        """Write ``requests`` in the calling thread."""

    def _close_fds(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(
        self, requests: Sequence[IORequest], batch: Callable[[Sequence[IORequest]], None]
    ) -> None:
        if not requests:
            return
        workers = min(self._threads, len(requests))
        if workers <= 1:
            batch(requests)
            return
        parts = [requests[i::workers] for i in range(workers)]
        pool = self._executor()
        futures = [pool.submit(batch, part) for part in parts[1:]]
        try:
            batch(parts[0])
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._threads - 1, thread_name_prefix=f"hicache-3fs-{self.kind}"
                )
            return self._pool


class PosixIO(SlotIO):
    """``os.preadv`` / ``os.pwritev`` straight into and out of the caller's buffers.

    Checked reads and writes (:meth:`read_checked`, :meth:`write_checked`) move a whole batch
    of values with :func:`~hicache_storage.kit.read_runs` and
    :func:`~hicache_storage.kit.write_runs`: the CRC32C of each chunk while it is cache-hot, on
    the native helper's threads, the GIL given up once a batch.
    """

    kind = "posix"

    def __init__(self, paths: Sequence[str], file_size: int, io_threads: int) -> None:
        super().__init__(paths, file_size, io_threads)
        self._runs = IOWorkers(io_threads, "hicache-3fs-posix-runs")

    def read_checked(
        self, runs: Sequence[Sequence[IORequest]], checked: Sequence[int]
    ) -> list[int] | None:
        """Read each run and CRC32C its first ``checked[i]`` bytes as they arrive (see base)."""
        with self._gate.inside():
            specs = [[(self.fds[r.file], r.offset, r.buffers) for r in run] for run in runs]
            results = read_runs(specs, checked, self._runs)
        for run, result in zip(runs, results, strict=True):
            if result.error:
                raise OSError(result.error, os.strerror(result.error))
            if result.read < sum(request.nbytes for request in run):
                last = run[-1]
                raise OSError(errno.EIO, f"{self.paths[last.file]} ends before {last.offset}")
        return [result.crc for result in results]

    def write_checked(self, runs: Sequence[Sequence[IORequest]]) -> list[int] | None:
        """Write each run and CRC32C its bytes as they go (see base)."""
        with self._gate.inside():
            specs = [[(self.fds[r.file], r.offset, r.buffers) for r in run] for run in runs]
            results = write_runs(specs, self._runs)
        for result in results:
            if result.error:
                raise OSError(result.error, os.strerror(result.error))
        return [result.crc for result in results]

    def _release(self) -> None:
        self._runs.close()
        super()._release()

    def _read_batch(self, requests: Sequence[IORequest]) -> None:
        for request in requests:
            self._read_one(request)

    def _write_batch(self, requests: Sequence[IORequest]) -> None:
        for request in requests:
            self._write_one(request)

    def _read_one(self, request: IORequest) -> None:
        if read_into(self.fds[request.file], request.buffers, request.offset) < request.nbytes:
            raise OSError(errno.EIO, f"{self.paths[request.file]} ends before {request.offset}")

    def _write_one(self, request: IORequest) -> None:
        write_from(self.fds[request.file], request.buffers, request.offset)


class _Rings(threading.local):
    """One worker thread's usrbio state: its rings and its registered staging iovec."""

    read: Any = None
    write: Any = None
    iov: Any = None
    shm: Any = None


class UsrbioIO(SlotIO):
    """3FS usrbio rings with registered shared-memory iovecs, one set per worker thread.

    Parameters
    ----------
    paths, file_size, io_threads
        As for :class:`SlotIO`.
    module
        The imported ``hf3fs_fuse.io`` module (or a fake with the same interface, in tests).
    mount
        The 3FS mount point the files are on.
    entries
        Ring entries: the most requests one submission carries.
    buffer_bytes
        Size of each thread's registered staging iovec; requests are cut to fit it.
    """

    kind = "usrbio"

    def __init__(
        self,
        paths: Sequence[str],
        file_size: int,
        io_threads: int,
        *,
        module: ModuleType,
        mount: str,
        entries: int,
        buffer_bytes: int,
    ) -> None:
        super().__init__(paths, file_size, io_threads)
        self.module = module
        self.mount = mount
        self.entries = entries
        self.buffer_bytes = buffer_bytes
        self._local = _Rings()
        self._states: list[_Rings] = []
        self._states_lock = threading.Lock()
        self._registered: list[int] = []
        try:
            for fd in self.fds:
                module.register_fd(fd)
                self._registered.append(fd)
        except BaseException:
            self.close()
            raise

    def _sync(self, files: Sequence[int]) -> None:
        """Flush the named files through usrbio (which also publishes their length)."""
        for file in files:
            self.module.force_fsync(self.fds[file])

    def _release(self) -> None:
        """Deregister the files, drop the rings and iovecs, close everything."""
        self._stop_pool()
        registered, self._registered = self._registered, []
        for fd in registered:
            with contextlib.suppress(Exception):
                self.module.deregister_fd(fd)
        with self._states_lock:
            states, self._states = self._states, []
        for state in states:
            state.read = state.write = state.iov = None
            if state.shm is not None:
                with contextlib.suppress(Exception):
                    state.shm.close()
                state.shm = None
        self._close_fds()

    def _rings(self) -> _Rings:
        state = self._local
        if state.iov is None:
            from multiprocessing import shared_memory

            shm = shared_memory.SharedMemory(size=self.buffer_bytes, create=True)
            try:
                state.iov = self.module.make_iovec(shm, self.mount, 0, -1)
            finally:
                shm.unlink()  # the iovec keeps its own link under the mount
            state.shm = shm
            state.read = self.module.make_ioring(self.mount, self.entries, True, 0)
            state.write = self.module.make_ioring(self.mount, self.entries, False, 0)
            with self._states_lock:
                self._states.append(state)
        return state

    def _read_batch(self, requests: Sequence[IORequest]) -> None:
        self._staged(requests, for_read=True)

    def _write_batch(self, requests: Sequence[IORequest]) -> None:
        self._staged(requests, for_read=False)

    def _staged(self, requests: Sequence[IORequest], *, for_read: bool) -> None:
        """Run ``requests`` through this thread's ring, as many per submission as fit."""
        state = self._rings()
        ring = state.read if for_read else state.write
        staging: memoryview = state.shm.buf
        pieces: list[tuple[int, int, list[memoryview]]] = []
        for request in requests:
            offset = request.offset
            for group in _chunks(request.buffers, self.buffer_bytes):
                pieces.append((request.file, offset, group))
                offset += sum(view.nbytes for view in group)
        start = 0
        while start < len(pieces):
            used = 0
            prepared: list[tuple[int, int, list[memoryview]]] = []
            for file, offset, group in pieces[start:]:
                size = sum(view.nbytes for view in group)
                if len(prepared) == self.entries or used + size > self.buffer_bytes:
                    break
                if not for_read:
                    at = used
                    for view in group:
                        staging[at : at + view.nbytes] = view
                        at += view.nbytes
                ring.prepare(
                    state.iov[used : used + size], for_read, self.fds[file], offset, userdata=size
                )
                prepared.append((used, size, group))
                used += size
            results = ring.submit().wait(min_results=len(prepared), max_results=len(prepared))
            if len(results) != len(prepared):
                raise OSError(errno.EIO, f"usrbio completed {len(results)} of {len(prepared)} I/Os")
            for result in results:
                if result.result != result.userdata:
                    code = -result.result if result.result < 0 else errno.EIO
                    raise OSError(code, f"usrbio moved {result.result} of {result.userdata} bytes")
            if for_read:
                for at, _, group in prepared:
                    for view in group:
                        view[:] = staging[at : at + view.nbytes]
                        at += view.nbytes
            start += len(prepared)


def load_usrbio() -> ModuleType | None:
    """Import ``hf3fs_fuse.io`` (3FS's usrbio binding), or return ``None`` when it is absent."""
    try:
        return importlib.import_module(USRBIO_MODULE)
    except ImportError:
        return None


def _mount_fstype(path: str) -> tuple[str, str] | None:
    """Return ``(mount point, fs type)`` of the longest mount containing ``path``."""
    best: tuple[str, str] | None = None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) > len(best[0])):
                    best = (point, fields[2])
    except OSError:
        return None
    return best


def find_3fs_mount(path: str, module: ModuleType | None) -> str | None:
    """Return the 3FS mount point ``path`` lies on, or ``None`` when it is not on one.

    The usrbio module's own ``extract_mount_point`` decides when it is available; otherwise the
    mount table is read and a FUSE mount whose type names 3FS counts.
    """
    real = os.path.realpath(path)
    if module is not None and hasattr(module, "extract_mount_point"):
        try:
            found = module.extract_mount_point(real)
        except Exception:  # noqa: BLE001 - any failure of the probe means "not a 3FS mount"
            return None
        return str(found) if found else None
    mount = _mount_fstype(real)
    if mount is not None and "3fs" in mount[1].lower():
        return mount[0]
    return None


def open_io(
    paths: Sequence[str],
    file_size: int,
    *,
    engine: Literal["auto", "posix", "usrbio"],
    io_threads: int,
    usrbio_entries: int,
    usrbio_buffer_bytes: int,
    module: ModuleType | None = None,
) -> SlotIO:
    """Create the data files and return the I/O engine for them.

    ``auto`` picks usrbio when ``hf3fs_fuse.io`` imports and the files are on a 3FS mount, POSIX
    otherwise; ``usrbio`` insists on it; ``posix`` never uses it. ``module`` replaces the import
    (tests pass a fake).

    Raises
    ------
    MissingDependencyError
        ``engine="usrbio"`` without the usrbio module.
    ConfigError
        ``engine="usrbio"`` for files that are not on a 3FS mount.
    OSError
        If the files cannot be created.
    """
    directory = os.path.dirname(os.path.abspath(paths[0]))
    if engine != "posix":
        usrbio = module if module is not None else load_usrbio()
        if usrbio is None and engine == "usrbio":
            raise MissingDependencyError(
                "io_engine='usrbio' needs 3FS's Python binding (module hf3fs_fuse.io), which is "
                "not installed; build hf3fs_py_usrbio from the 3FS source tree (it is not on "
                "PyPI in usable form; the '3fs' extra installs nothing) or use io_engine='posix'"
            )
        mount = find_3fs_mount(directory, usrbio) if usrbio is not None else None
        if mount is None and engine == "usrbio":
            raise ConfigError(f"io_engine='usrbio' but {directory!r} is not on a 3FS mount")
        if usrbio is not None and mount is not None:
            return UsrbioIO(
                paths,
                file_size,
                io_threads,
                module=usrbio,
                mount=mount,
                entries=usrbio_entries,
                buffer_bytes=usrbio_buffer_bytes,
            )
    return PosixIO(paths, file_size, io_threads)
