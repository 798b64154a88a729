"""Vectored positional I/O: more buffers than IOV_MAX, partial transfers, short files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache_storage.kit.vectored import IOV_MAX, advance, flat, read_into, write_from


def test_more_buffers_than_iov_max_round_trip(tmp_path: Path) -> None:
    count = IOV_MAX + 300
    data = [bytes([i % 251]) * (1 + i % 7) for i in range(count)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        write_from(fd, [memoryview(d) for d in data], offset=10)
        outs = [bytearray(len(d)) for d in data]
        total = sum(map(len, data))
        assert read_into(fd, [memoryview(o) for o in outs], offset=10) == total
        assert outs == [bytearray(d) for d in data]
        assert os.pread(fd, 10, 0) == b"\0" * 10
    finally:
        os.close(fd)


def test_short_file_reports_bytes_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abcdef")
    out = [bytearray(4), bytearray(4)]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_into(fd, [memoryview(o) for o in out]) == 6
    finally:
        os.close(fd)
    assert out == [bytearray(b"abcd"), bytearray(b"ef\0\0")]


def test_partial_transfers_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def one_byte(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, [buffers[0][:1]], offset)

    monkeypatch.setattr(os, "pwritev", one_byte)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        write_from(fd, [memoryview(b"hello"), memoryview(b""), memoryview(b"world")])
        assert os.pread(fd, 20, 0) == b"helloworld"
    finally:
        os.close(fd)


def test_advance_and_flat() -> None:
    pending = [memoryview(b"abc"), memoryview(b"de")]
    assert advance(pending, 0, 4) == 1 and bytes(pending[1]) == b"e"
    grid = memoryview(bytearray(6)).cast("B", (2, 3))
    assert flat(grid).ndim == 1 and flat(grid).nbytes == 6
