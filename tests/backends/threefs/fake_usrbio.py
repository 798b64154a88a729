"""A stand-in for 3FS's ``hf3fs_fuse.io`` module, for tests only: no 3FS can run here.

It implements the part of the interface :class:`~hicache_storage.backends.threefs.io.UsrbioIO`
uses (``make_iovec``, ``make_ioring`` with ``prepare``/``submit``/``wait``, ``register_fd``,
``deregister_fd``, ``force_fsync``, ``extract_mount_point``) with POSIX calls on the shared
memory, and checks the rules the real module enforces: I/O only on registered fds, read rings only
read, write rings only write, at most ``entries`` I/Os per submission.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any


class FakeUsrbio:
    """One fake module instance; ``mount`` is the directory it pretends is a 3FS mount."""

    def __init__(self, mount: str) -> None:
        self.mount = os.path.realpath(mount)
        self.registered: set[int] = set()
        self.submissions = 0
        self.fsyncs = 0

    def extract_mount_point(self, path: str) -> str | None:
        path = os.path.realpath(path)
        return self.mount if path == self.mount or path.startswith(self.mount + "/") else None

    def register_fd(self, fd: int) -> None:
        self.registered.add(fd)

    def deregister_fd(self, fd: int) -> None:
        self.registered.discard(fd)

    def force_fsync(self, fd: int) -> None:
        assert fd in self.registered
        self.fsyncs += 1
        os.fsync(fd)

    def make_iovec(
        self, shm: shared_memory.SharedMemory, mount: str, block_size: int = 0, numa: int = -1
    ) -> Iovec:
        assert mount == self.mount
        return Iovec(memoryview(shm.buf))

    def make_ioring(
        self, mount: str, entries: int, for_read: bool = True, io_depth: int = 0
    ) -> Ring:
        assert mount == self.mount
        return Ring(self, entries, for_read)


@dataclass
class Iovec:
    buf: memoryview

    def __getitem__(self, part: slice) -> memoryview:
        return self.buf[part]


@dataclass
class Result:
    result: int
    userdata: Any


class Ring:
    def __init__(self, module: FakeUsrbio, entries: int, for_read: bool) -> None:
        self.module = module
        self.entries = entries
        self.for_read = for_read
        self.prepared: list[tuple[memoryview, int, int, Any]] = []

    def prepare(
        self, iov: memoryview, read: bool, fd: int, offset: int, userdata: Any = None
    ) -> None:
        assert read is self.for_read, "a usrbio ring only reads or only writes"
        assert fd in self.module.registered, "I/O on an fd that was not registered"
        assert len(self.prepared) < self.entries, "more I/Os prepared than the ring holds"
        self.prepared.append((iov, fd, offset, userdata))

    def submit(self) -> Ring:
        self.module.submissions += 1
        return self

    def wait(self, min_results: int = 1, max_results: int | None = None) -> list[Result]:
        done = []
        for iov, fd, offset, userdata in self.prepared:
            move = os.preadv if self.for_read else os.pwritev
            moved = move(fd, [iov], offset)
            done.append(Result(moved, userdata))
        self.prepared = []
        assert len(done) >= min_results
        return done
