"""Checked page I/O (``kit.read_checked``, ``kit.write_checked``, ``kit.read_files``,
``kit.write_files``, ``kit.read_runs``, ``kit.write_runs``): moves that checksum as they go, one
page, a batch of one-file pages or a batch of values kept in ranges of large files.

The native loop and the Python path (a read, then a checksum) must agree with each other and with
the ``crc32c`` package on every split of a page into buffers, every chunk size, a value followed
by a record that is not checksummed, and a file shorter than the buffers.
"""

from __future__ import annotations

import errno
import os
import platform
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_storage.errors import BackendClosedError
from hicache_storage.kit import IOWorkers, pageio
from hicache_storage.kit.integrity import RECORD_BYTES, check
from hicache_storage.kit.pageio import (
    NATIVE_CHECKED_READS,
    PRESENT,
    PUBLISHED,
    UNLINKED,
    FileRead,
    FileWrite,
    RunRead,
    RunWrite,
    read_checked,
    read_files,
    read_runs,
    write_checked,
    write_files,
    write_runs,
)

X86 = platform.machine() in ("x86_64", "AMD64")

# The helper is built for x86-64 only (elsewhere the Python path serves). On x86-64 a helper that
# did not build fails these tests instead of skipping them.
ONLY_X86 = "the checked-I/O helper is built for x86-64 only; this machine runs the Python path"
needs_native = pytest.mark.skipif(not X86, reason=ONLY_X86)


@pytest.fixture(params=["native", "python"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if not X86:
            pytest.skip(ONLY_X86)
        assert NATIVE_CHECKED_READS, "the checked-I/O helper did not build on x86-64"
    else:
        monkeypatch.setattr(pageio, "_CHECKED", None)
    return str(request.param)


def test_the_helper_is_built_where_the_project_builds_it() -> None:
    # CI installs the package with a compiler on x86-64: the fast path must be there, or a
    # silent fallback would hide a build break.
    if X86:
        assert NATIVE_CHECKED_READS


@needs_native
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=40_000), value=st.integers(0, 2**32 - 1), skip=st.integers(0, 9))
def test_native_crc32c_matches_the_package(data: bytes, value: int, skip: int) -> None:
    from hicache_storage.kit import _checkedio

    view = memoryview(data)[min(skip, len(data)) :]  # unaligned starts too
    assert _checkedio.crc32c(view, value) == crc32c.crc32c(view, value=value)


@needs_native
def test_native_crc32c_over_long_runs() -> None:
    from hicache_storage.kit import _checkedio

    data = os.urandom((3 << 20) + 12_345)  # many three-stream rounds, then a ragged tail
    assert _checkedio.crc32c(data) == crc32c.crc32c(data)


def _split(data_len: int, cuts: list[int]) -> list[int]:
    points = sorted({min(c, data_len) for c in cuts})
    sizes, last = [], 0
    for point in [*points, data_len]:
        sizes.append(point - last)
        last = point
    return sizes


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 200_000),
    cuts=st.lists(st.integers(0, 200_000), max_size=6),
    chunk=st.sampled_from([1, 7, 4096, 65_536, 1 << 20]),
    record=st.sampled_from([0, 32]),
    missing=st.integers(0, 3_000),
)
def test_read_checked_fills_and_checksums(
    tmp_path_factory: pytest.TempPathFactory,
    size: int,
    cuts: list[int],
    chunk: int,
    record: int,
    missing: int,
) -> None:
    # Both paths in one example: the native one (where built) and the Python one.
    payload = os.urandom(size + record)
    file = tmp_path_factory.mktemp("checked") / "page"
    stored = payload[: max(0, len(payload) - missing)]  # a short file when missing > 0
    file.write_bytes(stored)
    results = []
    for native in (True, False):
        if native and not X86:
            continue
        buffers = [bytearray(n) for n in _split(size, cuts)] + [bytearray(record)]
        saved = pageio._CHECKED
        if not native:
            pageio._CHECKED = None
        try:
            fd = os.open(file, os.O_RDONLY)
            try:
                total, crc = read_checked(
                    fd, [memoryview(b) for b in buffers], size, chunk_bytes=chunk
                )
            finally:
                os.close(fd)
        finally:
            pageio._CHECKED = saved
        got = b"".join(buffers)
        assert total == len(stored)
        assert got[:total] == stored
        assert crc == crc32c.crc32c(stored[:size])
        results.append((total, crc, got))
    assert all(r == results[0] for r in results)


def test_read_checked_at_an_offset(path_kind: str, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    file = tmp_path / "page"
    file.write_bytes(data)
    out = bytearray(100_000)
    fd = os.open(file, os.O_RDONLY)
    try:
        total, crc = read_checked(fd, [memoryview(out)], 60_000, 150_000, chunk_bytes=8192)
    finally:
        os.close(fd)
    assert total == 100_000
    assert bytes(out) == data[150_000:250_000]
    assert crc == crc32c.crc32c(data[150_000:210_000])


def test_read_checked_of_a_bad_descriptor_is_an_os_error(path_kind: str, tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: preadv fails with EISDIR
    try:
        with pytest.raises(OSError):
            read_checked(fd, [memoryview(bytearray(10))], 10)
    finally:
        os.close(fd)


@needs_native
def test_native_read_refuses_read_only_buffers(tmp_path: Path) -> None:
    file = tmp_path / "page"
    file.write_bytes(b"x" * 16)
    fd = os.open(file, os.O_RDONLY)
    try:
        with pytest.raises(BufferError):
            read_checked(fd, [memoryview(b"\0" * 16)], 16)
    finally:
        os.close(fd)


@needs_native
def test_native_read_refuses_bad_arguments(tmp_path: Path) -> None:
    from hicache_storage.kit import _checkedio

    file = tmp_path / "page"
    file.write_bytes(b"x" * 16)
    fd = os.open(file, os.O_RDONLY)
    try:
        for offset, chunk, checked in ((-1, 8, 8), (0, 0, 8), (0, 8, -1)):
            with pytest.raises(ValueError, match="offset and checked"):
                _checkedio.read_checked(fd, [bytearray(16)], offset, chunk, checked)
        with pytest.raises(TypeError):
            _checkedio.read_checked(fd, 5, 0, 8, 8)  # type: ignore[arg-type]
    finally:
        os.close(fd)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70_000), max_size=5),
    chunk=st.sampled_from([1, 7, 4096, 65_536, 1 << 20]),
    offset=st.integers(0, 5_000),
)
def test_write_checked_writes_and_checksums(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], chunk: int, offset: int
) -> None:
    buffers = [os.urandom(n) for n in sizes]
    value = b"".join(buffers)
    for native in (True, False):
        if native and not X86:
            continue
        file = tmp_path_factory.mktemp("written") / "page"
        saved = pageio._CHECKED
        if not native:
            pageio._CHECKED = None
        try:
            fd = os.open(file, os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                total, crc = write_checked(
                    fd, [memoryview(b) for b in buffers], offset, chunk_bytes=chunk
                )
            finally:
                os.close(fd)
        finally:
            pageio._CHECKED = saved
        assert total == len(value)
        assert crc == crc32c.crc32c(value)
        assert file.read_bytes() == (b"\0" * offset + value if value else b"")


def test_write_checked_to_a_read_only_descriptor_is_an_os_error(
    path_kind: str, tmp_path: Path
) -> None:
    file = tmp_path / "page"
    file.write_bytes(b"")
    fd = os.open(file, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            write_checked(fd, [memoryview(b"x" * 100)])
    finally:
        os.close(fd)


@needs_native
def test_native_write_refuses_bad_arguments(tmp_path: Path) -> None:
    from hicache_storage.kit import _checkedio

    fd = os.open(tmp_path / "page", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for offset, chunk in ((-1, 8), (0, 0)):
            with pytest.raises(ValueError, match="offset must be"):
                _checkedio.write_checked(fd, [b"x"], offset, chunk)
        with pytest.raises(TypeError):
            _checkedio.write_checked(fd, [object()], 0, 8)  # type: ignore[list-item]
    finally:
        os.close(fd)


# -- whole batches of one-file pages (read_files, write_files) ----------------------------------


def _page(seed: int, sizes: tuple[int, ...]) -> list[memoryview]:
    return [memoryview(bytearray(os.urandom(n) if seed >= 0 else bytes(n))) for n in sizes]


@pytest.mark.parametrize("sizes", [(4096,), (1000, 1, 70_000), (300_000,)])
def test_write_files_then_read_files_round_trip_with_records(
    path_kind: str, tmp_path: Path, sizes: tuple[int, ...]
) -> None:
    keys = [f"k{i}" for i in range(9)]
    pages = [_page(i, sizes) for i in range(9)]
    paths = [str(tmp_path / key) for key in keys]
    temps = [str(tmp_path / f".{key}.tmp") for key in keys]
    with_workers = IOWorkers(4, "test-io")
    written = write_files(paths, temps, pages, keys, with_workers)
    assert written == [FileWrite(0, PUBLISHED)] * 9
    assert sorted(os.listdir(tmp_path)) == sorted(keys)  # no temporary file is left
    value = sum(sizes)
    for key, page, path in zip(keys, pages, paths, strict=True):
        raw = Path(path).read_bytes()
        assert raw[:value] == b"".join(bytes(v) for v in page)
        assert check(raw[value:], key, value, crc32c.crc32c(raw[:value])) is None
    outs = [_page(-1, sizes) for _ in keys]
    records = [bytearray(RECORD_BYTES) for _ in keys]
    got = read_files(
        paths,
        [[*o, memoryview(r)] for o, r in zip(outs, records, strict=True)],
        [value] * 9,
        with_workers,
    )
    for key, page, out, rec, result in zip(keys, pages, outs, records, got, strict=True):
        assert result.error == 0 and result.size == result.read == value + RECORD_BYTES
        assert [bytes(v) for v in out] == [bytes(v) for v in page]  # in order, each its own
        assert check(rec, key, value, result.crc) is None
    with_workers.close()


def test_read_files_reports_each_page_and_leaves_misfits_untouched(
    path_kind: str, tmp_path: Path
) -> None:
    (tmp_path / "ok").write_bytes(b"a" * 64)
    (tmp_path / "short").write_bytes(b"b" * 10)
    paths = [str(tmp_path / name) for name in ("ok", "missing", "short", "ok/under-a-file", "ok")]
    outs = [bytearray(b"\x00" * 64) for _ in paths]
    got = read_files(paths, [[memoryview(o)] for o in outs], [64] * 5, IOWorkers(3, "t"))
    assert got[0] == FileRead(0, 64, 64, crc32c.crc32c(b"a" * 64))
    assert got[1].error == errno.ENOENT
    assert got[2] == FileRead(0, 10, 0, got[2].crc)  # another size: not read
    assert got[3].error == errno.ENOTDIR
    assert got[4] == got[0]
    assert outs[0] == outs[4] == b"a" * 64
    assert outs[1] == outs[2] == outs[3] == b"\x00" * 64


def test_write_files_first_value_wins_and_failures_stay_per_page(
    path_kind: str, tmp_path: Path
) -> None:
    (tmp_path / "taken").write_bytes(b"first")
    names = ("new", "taken", "nodir/x", "new2")
    paths = [str(tmp_path / name) for name in names]
    temps = [str(tmp_path / (name + ".tmp")) for name in names]
    pages = [[memoryview(b"second")] for _ in names]
    got = write_files(paths, temps, pages, None, IOWorkers(2, "t"))
    assert got[0] == got[3] == FileWrite(0, PUBLISHED)
    assert got[1] == FileWrite(0, PRESENT)
    assert got[2].error == errno.ENOENT
    assert (tmp_path / "taken").read_bytes() == b"first"
    assert (tmp_path / "new").read_bytes() == b"second"  # no record without keys
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_write_files_leaves_the_temp_file_where_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pageio, "_CHECKED", None)  # the only path whose link() can be refused

    def refuse(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(pageio.os, "link", refuse)
    got = write_files(
        [str(tmp_path / "k")],
        [str(tmp_path / "k.tmp")],
        [[memoryview(b"v")]],
        None,
        IOWorkers(1, "t"),
    )
    assert got == [FileWrite(0, UNLINKED)]
    assert (tmp_path / "k.tmp").read_bytes() == b"v" and not (tmp_path / "k").exists()


def test_batches_refuse_misaligned_arguments_and_a_closed_pool(tmp_path: Path) -> None:
    workers = IOWorkers(2, "t")
    workers.close()
    with pytest.raises(BackendClosedError):
        read_files(["a", "b"], [[memoryview(bytearray(1))]] * 2, [1, 1], workers)
    if NATIVE_CHECKED_READS:
        from hicache_storage.kit import _checkedio

        with pytest.raises(ValueError, match="align"):
            _checkedio.read_files([b"a"], [], [], 0, 1, 1)
        with pytest.raises(TypeError, match="bytes"):
            _checkedio.read_files(["a"], [[bytearray(1)]], [1], 0, 1, 1)
        with pytest.raises(BufferError):  # read-only buffers cannot be read into
            _checkedio.read_files([b"a"], [[b"x"]], [1], 0, 1, 1)
        with pytest.raises(ValueError, match="digest"):
            _checkedio.write_files([b"a"], [b"b"], [[b"x"]], [], False, 1, 1)


def test_read_runs_fill_ranges_in_order_and_checksum_across_them(
    path_kind: str, tmp_path: Path
) -> None:
    a, b = os.urandom(300_000), os.urandom(300_000)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    fa = os.open(tmp_path / "a", os.O_RDONLY)
    fb = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        # run 0: 1,000 bytes of b at 5, then 70,000 of a at 100 (two buffers), then a 32-byte
        # "record" of b at 200,000 that the checksum leaves out; run 1: one range past the end.
        first = [bytearray(1000), bytearray(20_000), bytearray(50_000), bytearray(32)]
        runs = [
            [
                (fb, 5, [memoryview(first[0])]),
                (fa, 100, [memoryview(first[1]), memoryview(first[2])]),
                (fb, 200_000, [memoryview(first[3])]),
            ],
            [(fa, 299_990, [memoryview(bytearray(20))])],
            [(fb, 0, [memoryview(bytearray(8))])],
        ]
        got = read_runs(runs, [71_000, 20, 4], IOWorkers(3, "t"))
        value = b[5:1005] + a[100:70_100]
        assert bytes(first[0]) + bytes(first[1]) + bytes(first[2]) == value
        assert bytes(first[3]) == b[200_000:200_032]
        assert got[0] == RunRead(0, 71_032, crc32c.crc32c(value))
        assert got[1] == RunRead(0, 10, crc32c.crc32c(a[299_990:]))  # the file ended first
        assert got[2] == RunRead(0, 8, crc32c.crc32c(b[:4]))
    finally:
        os.close(fa)
        os.close(fb)
    closed = read_runs([[(fa, 0, [memoryview(bytearray(4))])]] * 2, [4, 4], IOWorkers(2, "t"))
    assert [r.error for r in closed] == [errno.EBADF, errno.EBADF]


def test_write_runs_write_ranges_in_order_and_checksum_across_them(
    path_kind: str, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(300_000))
    b.write_bytes(bytes(300_000))
    parts = [os.urandom(n) for n in (1000, 20_000, 50_000, 7)]
    fa = os.open(a, os.O_RDWR)
    fb = os.open(b, os.O_RDWR)
    try:
        # run 0: 1,000 bytes to b at 5, then two buffers to a at 100, chunked small so a run
        # spans many writes; run 1: 7 bytes past the end of a (the file grows); run 2: nothing.
        runs = [
            [
                (fb, 5, [memoryview(parts[0])]),
                (fa, 100, [memoryview(parts[1]), memoryview(parts[2])]),
            ],
            [(fa, 299_998, [memoryview(parts[3])])],
            [],
        ]
        got = write_runs(runs, IOWorkers(3, "t"), chunk_bytes=4096)
    finally:
        os.close(fa)
        os.close(fb)
    value = parts[0] + parts[1] + parts[2]
    assert got == [
        RunWrite(0, 71_000, crc32c.crc32c(value)),
        RunWrite(0, 7, crc32c.crc32c(parts[3])),
        RunWrite(0, 0, 0),
    ]
    assert b.read_bytes()[5:1005] == parts[0]
    assert a.read_bytes()[100:70_100] == parts[1] + parts[2]
    assert a.read_bytes()[299_998:] == parts[3]
    assert a.read_bytes()[:100] == bytes(100)  # nothing outside the ranges
    # A failed range stops its run there and is reported; the other runs are written.
    good = os.open(a, os.O_RDWR)
    ro = os.open(b, os.O_RDONLY)
    try:
        got = write_runs(
            [
                [(good, 0, [memoryview(b"xy")]), (ro, 0, [memoryview(b"z")])],
                [(good, 10, [memoryview(b"w")])],
            ],
            IOWorkers(2, "t"),
        )
    finally:
        os.close(good)
        os.close(ro)
    assert got[0] == RunWrite(errno.EBADF, 2, got[0].crc)
    assert got[1] == RunWrite(0, 1, crc32c.crc32c(b"w"))
    assert a.read_bytes()[:2] == b"xy" and a.read_bytes()[10:11] == b"w"
