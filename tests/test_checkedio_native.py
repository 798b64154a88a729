"""The native batch I/O helper's inputs (issue 48, item 9), and entries that are not files.

``kit._checkedio`` runs a batch on threads of its own without the GIL. Whatever the caller does
with its lists meanwhile (another thread changes them, an ``__index__`` it calls changes them),
each page is read from, and published under, the path it was given: the call holds what it
points into. A path holding a NUL byte is refused (``open`` would stop at the NUL and name
another file), and every route of the kit's batch calls (native or Python, one page or many)
checks its arguments the same way. ``scripts/asan.sh`` runs this file under AddressSanitizer.
"""

from __future__ import annotations

import ast
import gc
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_storage.kit import IOWorkers, pageio
from hicache_storage.kit.pageio import (
    NATIVE_CHECKED_READS,
    NOT_REGULAR,
    UNLINKED,
    FileRead,
    read_files,
    read_runs,
    write_files,
)

from .test_checked_reads import needs_native, path_kind

__all__ = ["path_kind"]

NAME_BYTES = 40
"""Every path in the swap tests has this many bytes, so a freed one's memory is reused by the
next one allocated (the allocator keeps freed blocks by size)."""


def files(root: Path, prefix: str, n: int, fill: int) -> list[bytes]:
    """Create ``n`` files of 64 bytes of ``fill + i``; return their paths, all one length."""
    paths = []
    for i in range(n):
        name = f"{prefix}{i:03d}"
        path = os.fsencode(root / name)
        path += b"x" * (NAME_BYTES - len(path)) if len(path) < NAME_BYTES else b""
        Path(os.fsdecode(path)).write_bytes(bytes([fill + i]) * 64)
        paths.append(path)
    return paths


@pytest.fixture
def root() -> Iterator[Path]:
    """A directory whose paths stay under :data:`NAME_BYTES` bytes long."""
    short = Path(tempfile.mkdtemp(prefix="cio", dir="/tmp"))
    yield short
    shutil.rmtree(short)


@needs_native
def test_a_list_changed_while_the_batch_is_prepared_frees_no_path_it_reads(root: Path) -> None:
    # read_files takes a page's buffers after its path: a page that is an iterable whose
    # __iter__ empties the caller's list of paths, and allocates decoy paths of the same size
    # in the memory that frees, must not make any page read from a decoy.
    from hicache_storage.kit import _checkedio

    real = files(root, "r", 8, 1)
    decoys = files(root, "d", 8, 101)
    kept: list[bytes] = []
    paths = [bytes(bytearray(p)) for p in real]  # the list holds the only references

    class Sneaky:
        def __init__(self, buffer: bytearray) -> None:
            self.buffer = buffer

        def __iter__(self) -> Iterator[bytearray]:
            paths.clear()
            gc.collect()
            # Fresh objects of the paths' size, enough to take every block the paths freed.
            kept.extend(bytes(bytearray(d)) for _ in range(250) for d in decoys)
            return iter([self.buffer])

    pages: list[object] = [[bytearray(64)] for _ in real[:-1]]
    last = bytearray(64)
    pages.append(Sneaky(last))  # the last page: every path was taken before it
    got = _checkedio.read_files(paths, pages, [64] * 8, os.O_RDONLY, 4096, 4)
    assert [row[0] for row in got] == [0] * 8
    filled = [bytes(page[0]) for page in pages[:-1]] + [bytes(last)]  # type: ignore[index]
    assert filled == [bytes([1 + i]) * 64 for i in range(8)]


@needs_native
def test_lists_changed_by_another_thread_during_a_batch_read_and_write(root: Path) -> None:
    # Another thread keeps replacing the items of the caller's lists while the native threads
    # run without the GIL: each page is still read from, and written to, the path it was given.
    from hicache_storage.kit import _checkedio

    real = files(root, "r", 16, 1)
    decoys = files(root, "d", 16, 101)
    stop = threading.Event()
    shared: list[list[bytes]] = []

    def churn() -> None:
        while not stop.is_set():
            for items in list(shared):
                for i in range(len(items)):
                    items[i] = bytes(bytearray(decoys[i % len(decoys)]))

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for round_ in range(60):
            paths = [bytes(bytearray(p)) for p in real]
            shared[:] = [paths]
            pages = [[bytearray(64)] for _ in real]
            got = _checkedio.read_files(paths, pages, [64] * 16, os.O_RDONLY, 4096, 8)
            assert [row[:3] for row in got] == [(0, 64, 64)] * 16
            want = [bytes([1 + i]) * 64 for i in range(16)]
            assert [bytes(page[0]) for page in pages] == want, f"round {round_}"
            targets = [os.fsencode(root / f"w{round_:02d}{i:02d}") for i in range(4)]
            temps = [t + b".tmp" for t in targets]
            names, tnames = list(targets), list(temps)
            shared[:] = [names, tnames]
            out = _checkedio.write_files(
                names, tnames, [[b"v%02d" % i] for i in range(4)], None, False, 4096, 4
            )
            assert out == [(0, 1)] * 4
            for i, target in enumerate(targets):
                assert Path(os.fsdecode(target)).read_bytes() == b"v%02d" % i
                os.unlink(target)
    finally:
        stop.set()
        thread.join()
    for decoy in decoys:
        assert Path(os.fsdecode(decoy)).read_bytes()[0] >= 101  # no decoy was written


def test_a_path_holding_a_nul_is_refused_on_every_route(path_kind: str, root: Path) -> None:
    (real,) = files(root, "f", 1, 7)
    nul = os.fsdecode(real) + "\x00decoy"
    workers = IOWorkers(2, "t")
    one = [[memoryview(bytearray(64))]]
    for paths, pages in (([nul], one), ([nul, os.fsdecode(real)], one * 2)):
        with pytest.raises(ValueError, match="NUL"):
            read_files(paths, pages, [64] * len(paths), workers)
        temps = [p + ".tmp" for p in paths]
        with pytest.raises(ValueError, match="NUL"):
            write_files(paths, temps, pages, None, workers)
        with pytest.raises(ValueError, match="NUL"):
            write_files([os.fsdecode(real)] * len(paths), paths, pages, None, workers)
    assert Path(os.fsdecode(real)).read_bytes() == bytes([7]) * 64
    workers.close()


@needs_native
def test_the_native_helper_refuses_a_nul_itself(root: Path) -> None:
    from hicache_storage.kit import _checkedio

    (real,) = files(root, "f", 1, 7)
    page = [[bytearray(64)], [bytearray(64)]]
    with pytest.raises(ValueError, match="NUL"):
        _checkedio.read_files([real + b"\x00x", real], page, [64, 64], os.O_RDONLY, 4096, 2)
    with pytest.raises(ValueError, match="NUL"):
        _checkedio.write_files(
            [b"a", b"b"], [b"t\x00", b"u"], [[b"x"], [b"y"]], None, False, 4096, 2
        )
    assert bytes(page[0][0]) == bytes(64)


def test_every_route_validates_its_arguments_alike(path_kind: str, root: Path) -> None:
    # One path with two pages, or with none, is refused as a batch of two paths would be,
    # with ValueError (the one-page route used to read one page, or raise IndexError).
    real = os.fsdecode(files(root, "f", 1, 7)[0])
    workers = IOWorkers(2, "t")
    page = [memoryview(bytearray(64))]
    for paths, pages, checked in (
        ([real], [page, page], [64]),
        ([real], [], []),
        ([real], [page], [64, 64]),
        ([real, real], [page], [64, 64]),
        ([real, real], [page, page], [64]),
    ):
        with pytest.raises(ValueError, match="align"):
            read_files(paths, pages, checked, workers)
    for paths, temps, pages in (
        ([real], [real + ".t"], [page, page]),
        ([real], [], [page]),
        ([real, real], [real + ".t"], [page, page]),
    ):
        with pytest.raises(ValueError, match="align"):
            write_files(paths, temps, pages, None, workers)
    with pytest.raises(ValueError, match="align"):
        write_files([real], [real + ".t"], [page], ["k", "k2"], workers)
    for runs, checked in (([[]], [1, 2]), ([[], []], [1])):
        with pytest.raises(ValueError, match="align"):
            read_runs(runs, checked, workers)
    workers.close()


def test_an_entry_that_is_not_a_file_is_never_read_nor_waited_on(
    path_kind: str, root: Path
) -> None:
    fifo, directory, sock_path = root / "fifo", root / "dir", root / "sock"
    os.mkfifo(fifo)
    directory.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    (good,) = files(root, "g", 1, 9)
    try:
        workers = IOWorkers(4, "t")
        entries = [str(fifo), str(directory), str(sock_path)]
        for paths in ([entries[0]], [entries[1]], [entries[2]], [*entries, os.fsdecode(good)]):
            outs = [bytearray(64) for _ in paths]
            box: list[list[FileRead]] = []
            reader = threading.Thread(
                target=lambda p=paths, o=outs, b=box: b.append(
                    read_files(p, [[memoryview(x)] for x in o], [64] * len(p), workers)
                ),
                daemon=True,
            )
            reader.start()
            reader.join(20)
            if reader.is_alive():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                reader.join(20)
                pytest.fail("read_files waited on a FIFO")
            got = box[0]
            assert [row.size for row in got[: len(entries)]][: len(paths)] == [NOT_REGULAR] * min(
                len(paths), len(entries)
            )
            assert all(row.error == 0 and row.read == 0 for row in got[: len(entries)])
            assert all(out == bytes(64) for out in outs[: len(entries)])
            if len(paths) > 1:
                assert got[-1].read == 64 and outs[-1] == bytes([9]) * 64
        # A write that meets such an entry leaves its temporary file to the caller (UNLINKED).
        temps = [str(root / f"t{i}") for i in range(3)]
        pages = [[memoryview(b"value")] for _ in range(3)]
        for i in range(3):
            got_w = write_files(entries[i : i + 1], temps[i : i + 1], pages[:1], None, workers)
            assert got_w[0] == (0, UNLINKED) and Path(temps[i]).read_bytes() == b"value"
            os.unlink(temps[i])
        assert write_files(entries, temps, pages, None, workers) == [(0, UNLINKED)] * 3
        workers.close()
    finally:
        sock.close()


def test_the_stub_declares_every_function_of_the_module() -> None:
    stub = Path(pageio.__file__).with_name("_checkedio.pyi")
    declared = {
        node.name for node in ast.parse(stub.read_text()).body if isinstance(node, ast.FunctionDef)
    }
    assert declared == {
        "crc32c",
        "read_checked",
        "write_checked",
        "read_files",
        "write_files",
        "read_runs",
        "write_runs",
    }
    if NATIVE_CHECKED_READS:
        from hicache_storage.kit import _checkedio

        public = {name for name in dir(_checkedio) if not name.startswith("_")}
        assert public == declared
