"""The I/O engines move exactly the requested bytes; usrbio is checked against a fake module.

No 3FS can run here, so :class:`UsrbioIO` runs against ``fake_usrbio.FakeUsrbio``, a stand-in
for ``hf3fs_fuse.io`` that does POSIX I/O on the registered shared memory.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backends.threefs.io import (
    IORequest,
    PosixIO,
    SlotIO,
    UsrbioIO,
    find_3fs_mount,
    load_usrbio,
    open_io,
)
from hicache_storage.errors import ConfigError, MissingDependencyError
from hicache_storage.hostpool import HostKVPool

from ...helpers import make_pool
from .fake_usrbio import FakeUsrbio

FILE = 1 << 20


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def page_bytes(pool: HostKVPool, page: int) -> bytes:
    data = pool.get_data_page(page * pool.page_size).contiguous()
    return bytes(data.reshape(-1).view(torch.uint8).numpy())


def requests_over(buffers: list[memoryview]) -> list[IORequest]:
    """Scatter pieces of ``buffers`` over both files at odd offsets, several buffers per request."""
    return [
        IORequest(0, 4096, buffers[0:2]),
        IORequest(1, 0, [buffers[2]]),
        IORequest(1, FILE - buffers[3].nbytes, [buffers[3]]),
        IORequest(0, 100_000, buffers[4:]),
    ]


def roundtrip(io: SlotIO) -> None:
    sizes = [5000, 1, 70_000, 12_345, 300, 65_536]
    data = [pattern(n, i) for i, n in enumerate(sizes)]
    io.write(requests_over([memoryview(d) for d in data]))
    outs = [bytearray(n) for n in sizes]
    io.read(requests_over([memoryview(o) for o in outs]))
    assert [bytes(o) for o in outs] == data
    with open(io.paths[1], "rb") as f:
        f.seek(FILE - sizes[3])
        assert f.read() == data[3]


@pytest.mark.parametrize("threads", [1, 4])
def test_posix_roundtrip_and_file_sizes(tmp_path: Path, threads: int) -> None:
    paths = [str(tmp_path / f"f{i}.bin") for i in range(2)]
    io = PosixIO(paths, FILE, threads)
    try:
        assert [os.path.getsize(p) for p in paths] == [FILE, FILE]
        roundtrip(io)
        io.sync([0, 1, 1])
    finally:
        io.close()
    assert io.fds == []


def test_posix_read_past_the_end_raises(tmp_path: Path) -> None:
    io = PosixIO([str(tmp_path / "f.bin")], 4096, 1)
    try:
        with pytest.raises(OSError):
            io.read([IORequest(0, 4000, [memoryview(bytearray(200))])])
    finally:
        io.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_usrbio_roundtrip_through_fake_module(tmp_path: Path, threads: int) -> None:
    fake = FakeUsrbio(str(tmp_path))
    paths = [str(tmp_path / f"f{i}.bin") for i in range(2)]
    io = UsrbioIO(
        paths, FILE, threads, module=fake, mount=fake.mount, entries=2, buffer_bytes=16 << 10
    )
    try:
        assert fake.registered == set(io.fds)
        roundtrip(io)  # pieces larger than the staging iovec and more than 2 per submission
        assert fake.submissions > 4
        io.sync([1])
        assert fake.fsyncs == 1
    finally:
        io.close()
    assert fake.registered == set() and io.fds == []


def test_open_io_picks_posix_off_3fs(tmp_path: Path) -> None:
    assert load_usrbio() is None  # the binding cannot be installed here
    assert find_3fs_mount(str(tmp_path), None) is None
    io = open_io(
        [str(tmp_path / "f.bin")],
        4096,
        engine="auto",
        io_threads=1,
        usrbio_entries=4,
        usrbio_buffer_bytes=4096,
    )
    assert isinstance(io, PosixIO)
    io.close()


def test_open_io_usrbio_needs_module_and_mount(tmp_path: Path) -> None:
    common: dict[str, Any] = {"io_threads": 1, "usrbio_entries": 4, "usrbio_buffer_bytes": 4096}
    with pytest.raises(MissingDependencyError, match=r"hf3fs_fuse\.io"):
        open_io([str(tmp_path / "f.bin")], 4096, engine="usrbio", **common)
    elsewhere = FakeUsrbio(str(tmp_path / "mnt"))
    with pytest.raises(ConfigError, match="not on a 3FS mount"):
        open_io([str(tmp_path / "f.bin")], 4096, engine="usrbio", module=elsewhere, **common)
    mounted = FakeUsrbio(str(tmp_path))
    io = open_io([str(tmp_path / "f.bin")], 4096, engine="auto", module=mounted, **common)
    assert isinstance(io, UsrbioIO) and io.mount == mounted.mount
    io.close()
    posix = open_io([str(tmp_path / "g.bin")], 4096, engine="posix", module=mounted, **common)
    assert isinstance(posix, PosixIO)
    posix.close()


def test_backend_over_fake_usrbio_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeUsrbio(str(tmp_path))
    module = types.ModuleType("hf3fs_fuse.io")
    for name in (
        "extract_mount_point",
        "register_fd",
        "deregister_fd",
        "force_fsync",
        "make_iovec",
        "make_ioring",
    ):
        setattr(module, name, getattr(fake, name))
    package = types.ModuleType("hf3fs_fuse")
    package.io = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", package)
    monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", module)
    options = {
        "path": str(tmp_path / "kv"),
        "file_size": 1 << 20,
        "file_count": 2,
        "slot_bytes": 4096,
        "fsync": "before_commit",
    }
    with create_backend("3fs", options) as backend:
        assert backend.stats()["io_engine"] == "usrbio"
        value = pattern(50_000, 1)
        assert backend.set("k", value) and bytes(backend.get("k")) == value
        source, target = make_pool("mha", "layer_first"), make_pool("mha", "layer_first")
        raw = source.kv_buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        backend.register_host_pool(source)
        assert backend.batch_set_v1(["p0", "p1"], list(range(8))) == [True, True]
        backend.register_host_pool(target)
        assert backend.batch_get_v1(["p1", "p0"], list(range(8))) == [True, True]
        assert page_bytes(target, 0) == page_bytes(source, 1)
        assert page_bytes(target, 1) == page_bytes(source, 0)
        assert fake.fsyncs >= 2 and fake.submissions >= 4
    assert fake.registered == set()
