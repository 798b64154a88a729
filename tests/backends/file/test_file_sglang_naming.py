"""The file backend's ``naming="sglang_file_compat"`` mode: SGLang ``HiCacheFile``'s layout.

These tests do not import SGLang: they lay files out the way its ``HiCacheFile`` does
(``root/<key>.bin`` holding bare bytes, written as ``.<uuid hex>.tmp`` then renamed) and check
that this backend reads, extends, indexes, evicts and clears such a directory without touching
anything that is not one of its objects or its own temporary files.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backends.file import FileBackend, FileConfig
from hicache_storage.backends.file import plugin as file_plugin
from hicache_storage.config import Deployment
from hicache_storage.errors import BufferSizeError, ConfigError
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool
from hicache_storage.kit.integrity import RECORD_BYTES

COMPAT: Final = "sglang_file_compat"
OUR_TEMP = re.compile(r"\.[A-Za-z0-9][A-Za-z0-9_.\-]*\.tmp\.[0-9]+\.[0-9a-f]{12}")


def make(tmp_path: Path, deployment: Deployment | None = None, **options: Any) -> FileBackend:
    config = FileConfig(root=str(tmp_path), naming=COMPAT, **options)
    return FileBackend(config, deployment or Deployment())


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[FileBackend]:
    with make(tmp_path) as b:
        yield b


def page_hash(i: int) -> str:
    return hashlib.sha256(bytes([i])).hexdigest()


def sglang_write(root: Path, key: str, data: bytes, mtime: float | None = None) -> Path:
    """Publish ``data`` under ``key`` as SGLang's HiCacheFile does: a hidden temp, then rename."""
    tmp = root / f".{uuid.uuid4().hex}.tmp"
    tmp.write_bytes(data)
    path = root / f"{key}.bin"
    os.replace(tmp, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def sglang_read(root: Path, key: str, size: int) -> bytes | None:
    """Read ``key`` as SGLang's HiCacheFile does: ``readinto`` a buffer of exactly ``size``."""
    try:
        with open(root / f"{key}.bin", "rb", buffering=0) as f:
            buf = bytearray(size)
            if f.readinto(buf) != size:
                return None
            return bytes(buf)
    except FileNotFoundError:
        return None


def sglang_objects(root: Path) -> set[str]:
    """The keys SGLang's metadata scan would see in ``root``."""
    return {name[:-4] for name in os.listdir(root) if name.endswith(".bin")}


def age(path: Path, seconds: float = 3600.0) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


class Foreign:
    """Files in a shared directory that are not this backend's: it must leave them all alone."""

    def __init__(self, root: Path) -> None:
        self.sglang_temp = root / f".{uuid.uuid4().hex}.tmp"  # a HiCacheFile write in flight
        self.non_key_bins = [root / "_not-a-key.bin", root / ".hidden.bin", root / "a..b.bin"]
        self.other = root / "README"
        for path in (self.sglang_temp, *self.non_key_bins, self.other):
            path.write_bytes(b"foreign")
            age(path)  # old enough to count as stale if it were mistaken for our temp

    def intact(self) -> bool:
        paths = (self.sglang_temp, *self.non_key_bins, self.other)
        return all(path.read_bytes() == b"foreign" for path in paths)


# -- the layout ---------------------------------------------------------------------------------


def test_objects_are_flat_bin_files_of_bare_values(backend: FileBackend, tmp_path: Path) -> None:
    data = os.urandom(4096)
    assert backend.set("k1", data)
    assert backend.set("key.with.dots", b"")
    assert sorted(os.listdir(tmp_path)) == ["k1.bin", "key.with.dots.bin"]
    assert (tmp_path / "k1.bin").read_bytes() == data  # no integrity record
    assert backend.path_of("k1") == str(tmp_path / "k1.bin")
    assert sglang_read(tmp_path, "k1", 4096) == data
    assert backend.get("key.with.dots") == b""


def test_a_key_ending_in_bin_keeps_its_suffix(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        assert b.set("a.bin", b"v")
    assert os.listdir(tmp_path) == ["a.bin.bin"]
    with make(tmp_path) as b:
        assert b.stats()["objects"] == 1
        assert b.get("a.bin") == b"v"
        assert b.get("a") is None


def test_temporary_files_are_ours_and_never_bin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temps: list[str] = []
    real_link = os.link

    def spy(src: str, dst: str, *args: Any, **kwargs: Any) -> None:
        temps.append(src)
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", spy)
    with make(tmp_path) as b:
        assert b.set("k", b"value")
        assert b.batch_set(["a.bin", "b"], [b"1", b"2"]) == [True, True]
    assert len(temps) == 3
    for temp in temps:
        assert os.path.dirname(temp) == str(tmp_path)
        name = os.path.basename(temp)
        assert OUR_TEMP.fullmatch(name) and not name.endswith(".bin"), name
    assert sglang_objects(tmp_path) == {"k", "a.bin", "b"}


def test_stats_and_capabilities(backend: FileBackend) -> None:
    backend.set("k", b"12345")
    stats = backend.stats()
    assert stats["naming"] == COMPAT and stats["integrity"] is False
    assert (stats["objects"], stats["bytes"]) == (1, 5)
    caps = backend.capabilities
    assert caps.persistent and caps.shared and caps.native_zero_copy
    assert caps.delete and caps.crash_safe_writes and caps.atomic_first_wins
    assert caps.exists_stale_s == 5.0


def test_first_value_wins(backend: FileBackend, tmp_path: Path) -> None:
    assert backend.set("k", b"first")
    assert backend.set("k", b"second")
    with make(tmp_path, metadata_cache=False) as other:
        assert other.set("k", b"third")
    assert (tmp_path / "k.bin").read_bytes() == b"first"


def test_delete(backend: FileBackend, tmp_path: Path) -> None:
    backend.set("k", b"v")
    assert backend.delete("k")
    assert not (tmp_path / "k.bin").exists()
    assert not backend.delete("k")


# -- sharing a directory with HiCacheFile -------------------------------------------------------


def test_reads_and_extends_a_directory_sglang_wrote(tmp_path: Path) -> None:
    keys = [page_hash(i) + "_m_0_1" for i in range(4)]
    values = [os.urandom(1000 + i) for i in range(4)]
    for key, value in zip(keys, values, strict=True):
        sglang_write(tmp_path, key, value)
    foreign = Foreign(tmp_path)
    with make(tmp_path, stale_temp_s=0.0) as b:
        stats = b.stats()
        assert (stats["objects"], stats["bytes"]) == (4, sum(map(len, values)))
        assert b.batch_exists(keys) == 4
        for key, value in zip(keys, values, strict=True):
            assert b.get(key) == value
            out = bytearray(len(value))
            assert b.get(key, out) is out and out == value
        assert b.set(keys[0], b"not written: the first value wins")
        new_key = page_hash(9) + "_m_0_1"
        new_value = os.urandom(1234)
        assert b.set(new_key, new_value)
        assert b.stats()["objects"] == 5
        assert not b.exists("README")  # a file that is not `<key>.bin` is no object
    assert (tmp_path / f"{keys[0]}.bin").read_bytes() == values[0]
    assert sglang_read(tmp_path, new_key, 1234) == new_value
    assert sglang_objects(tmp_path) == {*keys, new_key, "_not-a-key", ".hidden", "a..b"}
    assert foreign.intact()


def test_scan_removes_only_our_stale_temps(tmp_path: Path) -> None:
    sglang_write(tmp_path, "k", b"v")
    foreign = Foreign(tmp_path)
    ours_stale = tmp_path / ".k.tmp.123.0123456789ab"
    ours_fresh = tmp_path / ".j.tmp.456.ba9876543210"
    ours_stale.write_bytes(b"partial")
    ours_fresh.write_bytes(b"partial")
    age(ours_stale)
    with make(tmp_path) as b:
        assert b.stats()["objects"] == 1
    assert not ours_stale.exists()
    assert ours_fresh.exists()
    with make(tmp_path, stale_temp_s=0.0) as b:
        assert b.stats()["objects"] == 1
    assert not ours_fresh.exists()
    assert foreign.intact()
    assert (tmp_path / "k.bin").read_bytes() == b"v"


def test_clear_removes_objects_and_our_stale_temps_only(tmp_path: Path) -> None:
    for i in range(3):
        sglang_write(tmp_path, f"s{i}", b"sglang")
    with make(tmp_path) as b:
        b.set("ours", b"v")
        foreign = Foreign(tmp_path)
        ours_stale = tmp_path / ".k.tmp.123.0123456789ab"
        ours_fresh = tmp_path / ".k.tmp.123.ffffffffffff"  # a write in flight
        ours_stale.write_bytes(b"partial")
        ours_fresh.write_bytes(b"partial")
        age(ours_stale)
        b.clear()
        assert b.stats()["objects"] == 0
        assert not b.exists("s0") and b.get("ours") is None
    assert sglang_objects(tmp_path) == {"_not-a-key", ".hidden", "a..b"}
    assert not ours_stale.exists()
    assert ours_fresh.exists()
    assert foreign.intact()


def test_rank_ownership_clears_only_this_ranks_keys(tmp_path: Path) -> None:
    rank0, rank1 = Deployment(tp_rank=0, tp_size=2), Deployment(tp_rank=1, tp_size=2)
    keys0 = [rank0.rank_suffix().key(page_hash(i)) for i in range(3)]
    keys1 = [rank1.rank_suffix().key(page_hash(i)) for i in range(3)]
    for key in [*keys0, *keys1]:
        sglang_write(tmp_path, key, b"kv")
    foreign = Foreign(tmp_path)
    ours_stale = tmp_path / ".k.tmp.123.0123456789ab"
    ours_stale.write_bytes(b"partial")
    age(ours_stale)
    with make(tmp_path, rank0, ownership="rank", stale_temp_s=1e6) as b0:
        assert b0.stats()["objects"] == 3
        assert b0.batch_exists(keys1) == 3  # reads are never restricted
        b0.clear()
    assert sglang_objects(tmp_path) == {*keys1, "_not-a-key", ".hidden", "a..b"}
    assert ours_stale.exists()  # a rank's clear leaves temporary files to the owner of "all"
    assert foreign.intact()


def test_eviction_covers_sglang_objects_and_skips_foreign_files(tmp_path: Path) -> None:
    now = time.time()
    keys = [f"old{i}" for i in range(5)]
    for i, key in enumerate(keys):
        sglang_write(tmp_path, key, b"x" * 100, mtime=now - 1000 + i)
    foreign = Foreign(tmp_path)
    with make(tmp_path, max_bytes=300, low_watermark=0.5) as b:
        # The scan indexes 500 bytes, oldest first, and evicts down to 150.
        stats = b.stats()
        assert (stats["objects"], stats["bytes"], stats["evictions"]) == (1, 100, 4)
        assert sglang_objects(tmp_path) == {"old4", "_not-a-key", ".hidden", "a..b"}
        assert b.get("old4") == b"x" * 100
        # One at a time: a batch writes its pages in parallel, so which of them is newest, and
        # so survives the eviction n3 triggers, would be up to the threads.
        for key in ("n1", "n2", "n3"):
            assert b.set(key, b"y" * 100)
        assert b.stats()["bytes"] <= 300
        assert b.exists("n3")
    assert foreign.intact()


# -- reading bare values ------------------------------------------------------------------------


def test_size_mismatch_and_truncation(backend: FileBackend, tmp_path: Path) -> None:
    backend.set("k", b"v" * 100)
    with pytest.raises(BufferSizeError):
        backend.get("k", bytearray(99))
    with open(tmp_path / "k.bin", "r+b") as f:  # truncated underneath: nothing vouches for it
        f.truncate(50)
    with make(tmp_path, metadata_cache=False) as other:
        assert other.get("k") == b"v" * 50  # bare values: the filesystem is trusted
    assert file_plugin.hicache_conformance_corrupt(backend, "k", 0) is None


def make_pool(kind: str, layout: str, pages: int = 8, page_size: int = 4) -> HostKVPool:
    if kind == "mha":
        return MHAHostPool(
            pages * page_size, page_size, 3, 2, 8, torch.bfloat16, layout, pin_memory=False
        )
    return MLAHostPool(
        pages * page_size, page_size, 3, 24, torch.bfloat16, layout, pin_memory=False
    )


def indices(pool: HostKVPool, pages: list[int]) -> torch.Tensor:
    size = pool.page_size
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])


def page_of(pool: HostKVPool, page: int) -> bytes:
    obj = bytearray(pool.page_nbytes)
    pool.read_page(page * pool.page_size, obj)
    return bytes(obj)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_v1_pages_are_bare_bin_files(
    backend: FileBackend, tmp_path: Path, kind: str, layout: str
) -> None:
    source, target = make_pool(kind, layout), make_pool(kind, layout)
    gen = torch.Generator().manual_seed(3)
    flat = source.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    target.kv_buffer.view(-1).view(torch.uint8).fill_(0)
    backend.register_host_pool(source)
    assert backend.batch_set_v1(["p0", "p1"], indices(source, [1, 6])) == [True, True]
    page = source.page_nbytes
    assert sglang_read(tmp_path, "p0", page) == page_of(source, 1)
    assert sglang_read(tmp_path, "p1", page) == page_of(source, 6)
    sglang_write(tmp_path, "s0", page_of(source, 3))  # a page SGLang stored
    backend.register_host_pool(target)
    hits = backend.batch_get_v1(["p0", "s0", "absent"], indices(target, [0, 2, 5]))
    assert hits == [True, True, False]
    assert page_of(target, 0) == page_of(source, 1)
    assert page_of(target, 2) == page_of(source, 3)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"fanout": True}, {"integrity": True}, {"fanout": True, "integrity": True}],
)
def test_compat_refuses_fanout_and_integrity(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"fanout and integrity") as info:
        FileConfig(root="/tmp/x", naming=COMPAT, **options)
    for name in options:
        assert f"{name}=True" in str(info.value)
    with pytest.raises(msgspec.ValidationError, match=r"sglang_file_compat"):
        msgspec.convert({"root": "/tmp/x", "naming": COMPAT, **options}, FileConfig)


def test_compat_defaults_and_explicit_false() -> None:
    for config in (
        FileConfig(root="/tmp/x", naming=COMPAT),
        FileConfig(root="/tmp/x", naming=COMPAT, fanout=False, integrity=False),
    ):
        assert (config.use_fanout, config.use_integrity) == (False, False)


@pytest.mark.parametrize(
    "options", [{"naming": "sglang"}, {"naming": None}, {"fanout": "yes"}, {"integrity": 1}]
)
def test_bad_naming_options(options: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"root": "/tmp/x", **options}, FileConfig)
    with pytest.raises((TypeError, ValueError)):
        FileConfig(root="/tmp/x", **options)


def test_default_naming_is_unchanged(tmp_path: Path) -> None:
    config = FileConfig(root=str(tmp_path))
    assert (config.naming, config.fanout, config.integrity) == ("hicache", None, None)
    assert (config.use_fanout, config.use_integrity) == (True, True)
    with FileBackend(config) as b:
        b.set("k", b"value")
        path = Path(b.path_of("k"))
        assert path.name == "k" and path.parent.parent.parent == tmp_path
        assert path.stat().st_size == 5 + RECORD_BYTES
        assert b.stats()["naming"] == "hicache"
    flat = tmp_path / "flat"
    with FileBackend(FileConfig(root=str(flat), fanout=False, integrity=False)) as b:
        b.set("k", b"value")
        assert os.listdir(flat) == ["k"]
        assert (flat / "k").read_bytes() == b"value"


def test_default_naming_ignores_bin_files(tmp_path: Path) -> None:
    sglang_write(tmp_path, "k", b"v")
    with FileBackend(FileConfig(root=str(tmp_path), fanout=False, integrity=False)) as b:
        assert b.get("k") is None
        assert b.get("k.bin") == b"v"  # in the default naming the file name is the key


def test_through_create_backend(tmp_path: Path) -> None:
    sglang_write(tmp_path, "s", b"from sglang")
    with create_backend("file", {"root": str(tmp_path), "naming": COMPAT}) as b:
        assert b.get("s") == b"from sglang"
        assert b.set("h", b"from hicache")
        assert b.batch_exists(["s", "h", "absent"]) == 2
        assert b.stats()["naming"] == COMPAT
    assert sglang_read(tmp_path, "h", 12) == b"from hicache"
    with pytest.raises(ConfigError, match="fanout and integrity"):
        create_backend("file", {"root": str(tmp_path), "naming": COMPAT, "fanout": True})
