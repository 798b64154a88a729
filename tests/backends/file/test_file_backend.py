"""The file backend: contract, zero-copy page I/O, atomic publishing, capacity and ownership."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backends.file import FileBackend, FileConfig
from hicache_storage.backends.file.baseline import RawDiskBaseline
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendClosedError,
    BackendIOError,
    BatchMismatchError,
    BufferSizeError,
    ConfigError,
    IndexAlignmentError,
    InvalidValueError,
    PoolNotRegisteredError,
)
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool
from hicache_storage.kit import pageio
from hicache_storage.kit.integrity import RECORD_BYTES
from hicache_storage.layers.verify import record_key

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
SENTINEL = 0xA5


def make(tmp_path: Path, deployment: Deployment | None = None, **options: Any) -> FileBackend:
    return FileBackend(FileConfig(root=str(tmp_path), **options), deployment or Deployment())


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[FileBackend]:
    with make(tmp_path) as b:
        yield b


def files_under(root: Path) -> dict[str, int]:
    """Every file under ``root`` outside the baseline directory, by name, with its value size."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".raw-baseline"]
        for name in filenames:
            found[name] = os.stat(os.path.join(dirpath, name)).st_size - RECORD_BYTES
    return found


def disk_bytes(root: Path) -> int:
    """The bytes of every file under ``root`` outside the baseline directory, records included."""
    return sum(size + RECORD_BYTES for size in files_under(root).values())


def temps_under(root: Path) -> list[str]:
    return [name for name in files_under(root) if ".tmp." in name]


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# -- values of every buffer type ----------------------------------------------------------------


def as_type(kind: str, data: bytes) -> Any:
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    if kind == "numpy":
        return np.frombuffer(data, dtype=np.float32).reshape(4, -1).copy()
    return torch.frombuffer(bytearray(data), dtype=torch.float16).reshape(8, -1)


KINDS = ["bytes", "bytearray", "memoryview", "numpy", "torch"]


@pytest.mark.parametrize("kind", KINDS)
def test_set_get_every_value_type(backend: FileBackend, kind: str) -> None:
    data = payload(4096, seed=len(kind))
    assert backend.set(f"key-{kind}", as_type(kind, data)) is True
    assert backend.exists(f"key-{kind}")
    got = backend.get(f"key-{kind}")
    assert isinstance(got, bytes)
    assert got == data


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "numpy", "torch"])
def test_get_into_every_output_type(backend: FileBackend, kind: str) -> None:
    data = payload(4096, seed=7)
    backend.set("k", data)
    out = as_type(kind, bytes(4096)) if kind != "memoryview" else memoryview(bytearray(4096))
    assert backend.get("k", out) is out
    if kind == "torch":
        assert out.numpy().tobytes() == data
    else:
        assert bytes(memoryview(out).cast("B")) == data


def test_get_into_wrong_size_raises_and_leaves_out_untouched(backend: FileBackend) -> None:
    backend.set("k", payload(100))
    for size in (99, 101, 0):
        out = bytearray(b"\x11" * size)
        with pytest.raises(BufferSizeError):
            backend.get("k", out)
        assert out == bytearray(b"\x11" * size)


def test_get_into_readonly_output_is_rejected(backend: FileBackend) -> None:
    backend.set("k", b"abc")
    with pytest.raises(InvalidValueError):
        backend.get("k", b"xyz")


def test_miss(backend: FileBackend) -> None:
    assert backend.get("absent") is None
    assert backend.get("absent", bytearray(3)) is None
    assert backend.exists("absent") is False
    assert backend.delete("absent") is False


def test_empty_value(backend: FileBackend) -> None:
    assert backend.set("empty", b"")
    assert backend.exists("empty")
    assert backend.get("empty") == b""
    assert backend.get("empty", bytearray()) is not None


def test_first_value_wins(backend: FileBackend) -> None:
    assert backend.set("k", b"first")
    assert backend.set("k", b"second!") is True
    assert backend.get("k") == b"first"
    # Also when the metadata cache does not know the key (another instance wrote it).
    other = FileBackend(backend.config, Deployment())
    assert other.set("k", b"third") is True
    assert other.get("k") == b"first"
    other.close()


def test_first_value_wins_across_threads(backend: FileBackend) -> None:
    values = [bytes([i]) * 65536 for i in range(8)]
    barrier = threading.Barrier(len(values))
    results: list[bool] = []

    def write(value: bytes) -> None:
        barrier.wait()
        results.append(backend.set("contended", value))

    threads = [threading.Thread(target=write, args=(v,)) for v in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * len(values)
    assert backend.get("contended") in values
    assert temps_under(Path(backend.root)) == []
    assert backend.stats()["bytes"] == 65536 + RECORD_BYTES


# -- layout on disk -----------------------------------------------------------------------------


def test_fanout_layout(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        b.set("some-key", b"v")
    digest = hashlib.blake2b(b"some-key", digest_size=2).hexdigest()
    stored = (tmp_path / digest[:2] / digest[2:] / "some-key").read_bytes()
    assert stored[:1] == b"v" and len(stored) == 1 + RECORD_BYTES


def test_flat_layout(tmp_path: Path) -> None:
    with make(tmp_path, fanout=False) as b:
        b.set("some-key", b"v")
        assert b.get("some-key") == b"v"
    assert sorted(os.listdir(tmp_path)) == ["some-key"]


def test_root_is_created(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    with FileBackend(FileConfig(root=str(root)), Deployment()) as b:
        assert b.set("k", b"v")
    assert root.is_dir()


def test_a_root_that_is_a_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    root.write_bytes(b"not a directory")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        FileBackend(FileConfig(root=str(root)), Deployment())
    assert root.read_bytes() == b"not a directory"


# -- batches ------------------------------------------------------------------------------------


def test_batch_calls_with_gaps(backend: FileBackend) -> None:
    keys = [f"k{i}" for i in range(6)]
    data = {k: payload(256, seed=i) for i, k in enumerate(keys)}
    present = ["k0", "k1", "k3", "k5"]
    assert backend.batch_set(present, [data[k] for k in present]) == [True] * 4
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(["k3", "k5", "k4"]) == 2
    assert backend.batch_exists([]) == 0
    outs = [bytearray(256) for _ in keys]
    assert backend.batch_get(keys, outs) == [True, True, False, True, False, True]
    for k, out in zip(keys, outs, strict=True):
        assert bytes(out) == (data[k] if k in present else bytes(256))
    # An output of the wrong size is a miss for that key only.
    outs = [bytearray(256), bytearray(10)]
    assert backend.batch_get(["k0", "k1"], outs) == [True, False]
    assert outs[1] == bytearray(10)


def test_batch_exists_without_metadata_cache(tmp_path: Path) -> None:
    with make(tmp_path, metadata_cache=False) as b:
        b.batch_set(["a", "b", "d"], [b"1", b"2", b"4"])
        assert b.batch_exists(["a", "b", "c", "d"]) == 2


def test_batch_length_mismatch(backend: FileBackend) -> None:
    with pytest.raises(BatchMismatchError):
        backend.batch_set(["a", "b"], [b"1"])
    with pytest.raises(BatchMismatchError):
        backend.batch_get(["a"], [])


# -- delete, clear, stats, close ----------------------------------------------------------------


def test_delete(backend: FileBackend) -> None:
    backend.set("k", b"value")
    assert backend.stats()["objects"] == 1
    assert backend.delete("k") is True
    assert backend.exists("k") is False
    assert backend.get("k") is None
    assert backend.delete("k") is False
    assert backend.stats()["objects"] == 0
    assert backend.set("k", b"again")
    assert backend.get("k") == b"again"


def test_clear(backend: FileBackend) -> None:
    backend.batch_set([f"k{i}" for i in range(20)], [b"x" * i for i in range(20)])
    backend.clear()
    assert backend.batch_exists(["k0"]) == 0
    assert not any(backend.exists(f"k{i}") for i in range(20))
    assert files_under(Path(backend.root)) == {}
    stats = backend.stats()
    assert (stats["objects"], stats["bytes"]) == (0, 0)
    backend.set("k1", b"new")
    assert backend.get("k1") == b"new"


def test_stats(backend: FileBackend) -> None:
    backend.set("a", b"12345")
    backend.set("b", b"678")
    stats = backend.stats()
    assert stats["backend"] == "file"
    assert stats["root"] == backend.root
    assert stats["objects"] == 2
    assert stats["bytes"] == 8 + 2 * RECORD_BYTES  # the files on disk, records included
    assert stats["evictions"] == 0
    assert stats["evicted_bytes"] == 0


def test_capabilities(tmp_path: Path) -> None:
    caps = make(tmp_path).capabilities
    assert caps.persistent and caps.shared and caps.native_zero_copy
    assert caps.delete and caps.crash_safe_writes and not caps.bounded
    assert make(tmp_path, max_bytes=1000).capabilities.bounded


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    b = make(tmp_path)
    b.set("k", b"v")
    b.close()
    b.close()
    assert b.closed
    for call in (lambda: b.get("k"), lambda: b.set("k", b"v"), lambda: b.exists("k")):
        with pytest.raises(BackendClosedError):
            call()


def test_context_manager(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        assert b.set("k", b"v")
    assert b.closed


def test_persistence_across_reopen(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        b.batch_set(["a", "b"], [b"alpha", b"beta"])
    with make(tmp_path) as b:
        assert b.get("a") == b"alpha"
        assert b.get("b") == b"beta"
        assert b.stats()["objects"] == 2
        assert b.stats()["bytes"] == 9 + 2 * RECORD_BYTES


def test_metadata_cache_trusts_positive_answers_for_ttl(tmp_path: Path) -> None:
    with (
        make(tmp_path, metadata_ttl_s=60.0) as cached,
        make(tmp_path, metadata_cache=False) as uncached,
    ):
        cached.set("k", b"v")
        assert uncached.delete("k")
        assert cached.exists("k")  # stale within the TTL, by design
        assert not uncached.exists("k")
        assert cached.get("k") is None  # a read finds out and drops the entry
        assert not cached.exists("k")


def test_metadata_cache_expires(tmp_path: Path) -> None:
    with make(tmp_path, metadata_ttl_s=0.05) as cached, make(tmp_path) as other:
        cached.set("k", b"v")
        other.delete("k")
        time.sleep(0.1)
        assert not cached.exists("k")


# -- crash safety of a single write -------------------------------------------------------------


def test_no_temp_left_after_writes(backend: FileBackend) -> None:
    backend.batch_set([f"k{i}" for i in range(10)], [b"v" * 1000] * 10)
    assert temps_under(Path(backend.root)) == []


@pytest.mark.parametrize("target", ["pwritev", "pwrite"])
def test_disk_full_leaves_no_key_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    b = make(tmp_path, max_bytes=1 << 20)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    if target == "pwrite":
        monkeypatch.delattr(os, "pwritev")
    monkeypatch.setattr(os, target, full)
    with pytest.raises(BackendIOError) as info:
        b.set("k", b"x" * 5000)
    assert info.value.errno == errno.ENOSPC
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert not b.exists("k")
    assert b.get("k") is None
    assert files_under(tmp_path) == {}
    stats = b.stats()
    assert (stats["objects"], stats["bytes"], stats["reserved_bytes"]) == (0, 0, 0)
    assert b.set("k", b"x" * 5000)  # the reservation was given back
    b.close()


def test_failed_publish_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = make(tmp_path)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "link", broken)
    with pytest.raises(BackendIOError):
        b.set("k", b"value")
    monkeypatch.undo()
    assert files_under(tmp_path) == {}
    b.close()


def test_partial_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    calls = []

    def trickle(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real(fd, [memoryview(buffers[0]).cast("B")[:1000]], offset)

    monkeypatch.setattr(os, "pwritev", trickle)
    monkeypatch.setattr(pageio, "_CHECKED", None)  # the Python path's loop (os.pwritev)
    data = payload(10_500)
    with make(tmp_path) as b:
        assert b.set("k", data)
        monkeypatch.undo()
        assert b.get("k") == data
    assert len(calls) == 12  # 11 for the value, 1 for the integrity record


def test_partial_reads_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv
    calls = []

    def trickle(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real(fd, [memoryview(buffers[0]).cast("B")[:1000]], offset)

    pool = make_pool("mha", "layer_first")
    fill(pool, None)
    with make(tmp_path) as b:
        b.register_host_pool(pool)
        data = payload(10_500)
        b.set("k", data)
        assert b.batch_set_v1(["p"], indices(pool, [1])) == [True]
        fill(pool, SENTINEL)
        monkeypatch.setattr(os, "preadv", trickle)
        monkeypatch.setattr(pageio, "_CHECKED", None)  # the Python path's loop (os.preadv)
        out = bytearray(10_500)
        assert b.get("k", out) is out
        assert out == data
        assert len(calls) == 12  # 11 for the value, 1 for the integrity record
        assert b.batch_get_v1(["p"], indices(pool, [2])) == [True]
        monkeypatch.undo()
        assert b.get("p") == bytes(page_of(pool, 2))


def test_link_unsupported_falls_back_to_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    with make(tmp_path) as b:
        assert b.set("k", b"first")
        other = make(tmp_path)
        assert other.set("k", b"second")
        assert b.get("k") == b"first"
        other.close()
    assert temps_under(tmp_path) == []


def test_truncated_underneath_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with make(tmp_path) as b:
        b.set("k", b"v" * 100)
        monkeypatch.setattr(pageio, "_CHECKED", None)  # so that os.preadv serves the read
        monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
        assert b.get("k", bytearray(100)) is None
        monkeypatch.setattr(os, "pread", lambda fd, n, offset: b"")
        assert b.get("k") is None


# -- startup scan -------------------------------------------------------------------------------


def test_startup_scan_counts_objects_and_removes_stale_temps(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        b.batch_set(["a", "b", "c"], [b"1" * 10, b"2" * 20, b"3" * 30])
        directory = Path(os.path.dirname(b.path_of("a")))
    stale = directory / ".a.tmp.1.deadbeef"
    fresh = directory / ".b.tmp.2.cafebabe"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with make(tmp_path) as b:
        stats = b.stats()
        assert (stats["objects"], stats["bytes"]) == (3, 60 + 3 * RECORD_BYTES)
        assert not b.exists(".a.tmp.1.deadbeef".lstrip("."))
    assert not stale.exists()
    assert fresh.exists()
    with make(tmp_path, stale_temp_s=0.0):
        pass
    assert not fresh.exists()


def test_startup_scan_ignores_baseline_and_misplaced_files(tmp_path: Path) -> None:
    baseline = RawDiskBaseline(FileConfig(root=str(tmp_path)), Deployment())
    baseline.batch_write(["x"], [memoryview(b"123")])
    (tmp_path / "stray").write_bytes(b"not in a fan-out directory")
    with make(tmp_path) as b:
        assert b.stats()["objects"] == 0
        b.clear()
    assert (tmp_path / "stray").exists()
    assert (tmp_path / ".raw-baseline" / "x").exists()
    baseline.close()


def test_flat_clear_leaves_files_that_are_not_keys(tmp_path: Path) -> None:
    (tmp_path / "notes~").write_bytes(b"not a key")
    with make(tmp_path, fanout=False) as b:
        b.set("k", b"v")
        assert b.stats()["objects"] == 1
        b.clear()
    assert sorted(os.listdir(tmp_path)) == ["notes~"]


def test_startup_scan_orders_by_mtime_and_enforces_capacity(tmp_path: Path) -> None:
    with make(tmp_path) as b:
        for i in range(10):
            b.set(f"k{i}", b"x" * 100)
        paths = [b.path_of(f"k{i}") for i in range(10)]
    now = time.time()
    for i, path in enumerate(paths):  # k9 oldest ... k0 newest
        os.utime(path, (now - 100 * (i + 1), now - 100 * (i + 1)))
    with make(tmp_path, max_bytes=500, low_watermark=0.5) as b:
        kept = [k for k in (f"k{i}" for i in range(10)) if b.exists(k)]
        assert kept == ["k0", "k1", "k2", "k3", "k4"][: len(kept)]
        assert b.stats()["bytes"] <= 500
        assert disk_bytes(tmp_path) <= 500


# -- capacity -----------------------------------------------------------------------------------


def test_value_larger_than_capacity_is_refused(tmp_path: Path) -> None:
    with make(tmp_path, max_bytes=1000) as b:
        assert b.set("small", b"x" * 10)
        assert b.set("big", b"x" * 1001) is False
        assert not b.exists("big")
        assert b.exists("small")
        assert files_under(tmp_path) == {"small": 10}


def test_bound_counts_the_files_on_disk(tmp_path: Path) -> None:
    """``max_bytes`` bounds the files as they are on disk: each value with its record."""
    with make(tmp_path, max_bytes=4096) as b:
        for i in range(200):
            assert b.set(f"k{i}", bytes([i]) * 64)
        assert disk_bytes(tmp_path) == b.stats()["bytes"] <= 4096
        assert b.set("over", b"x" * (4096 - RECORD_BYTES + 1)) is False
        assert b.set("whole", b"x" * (4096 - RECORD_BYTES))
        assert disk_bytes(tmp_path) == 4096


def test_batch_set_stores_what_set_one_by_one_stores(tmp_path: Path) -> None:
    """Values written on parallel threads never find the bound filled by their own batch."""
    big = 40_000  # two do not fit 64 KiB: the second evicts the first, as set() would
    with make(tmp_path, max_bytes=1 << 16, io_threads=4) as b:
        for trial in range(20):
            first, second = f"a{trial}", f"b{trial}"
            assert b.batch_set([first, second], [b"y" * big, b"z" * big]) == [True, True]
            assert b.get(second) == b"z" * big
            again = f"d{trial}"
            assert b.batch_set([again, again], [b"y" * big, b"y" * big]) == [True, True]
            assert b.get(again) == b"y" * big
            assert disk_bytes(tmp_path) <= 1 << 16


def test_a_bounded_page_leaves_with_its_verify_record(tmp_path: Path) -> None:
    """A page and the verify layer's record of it (an object of its own) are evicted together.

    ``get`` uses the page and not its record; were they apart in the LRU, the next eviction
    would take the record, b and b's record and keep a: a page answered as held whose every
    zero-copy read misses (``no_record``).
    """
    pool = make_pool("mha", "page_first")
    fill(pool, None)
    page, record = pool.page_nbytes + RECORD_BYTES, 2 * RECORD_BYTES
    bound = int((2 * page + record / 2) / 0.9)  # frees [record a, b, record b] and no more
    options = {"root": str(tmp_path), "max_bytes": bound, "min_free_bytes": 0}
    backend = create_backend("file", options)
    backend.register_host_pool(pool)
    for i, key in enumerate("abc"):
        assert backend.batch_set_v1([key], indices(pool, [i])) == [True]
        if key == "b":
            assert backend.get("a") is not None
    names = files_under(tmp_path)
    for key in "abc":
        held = backend.batch_exists([key]) == 1
        assert (key in names, record_key(key) in names) == (held, held)
        assert backend.batch_get_v1([key], indices(pool, [7])) == [held]
    assert backend.stats()["verify"]["no_record"] == 0
    backend.close()


def test_lru_keeps_recently_used_keys(tmp_path: Path) -> None:
    value = b"v" * (100 - RECORD_BYTES)  # files of 100 bytes
    with make(tmp_path, max_bytes=1000, low_watermark=0.9) as b:
        for i in range(10):
            assert b.set(f"k{i}", value)
        assert b.get("k0") == value  # k0 becomes the most recently used
        assert b.exists("k1")  # exists is not a use
        assert b.set("k10", value)  # 1100 > 1000: evict down to 900 - 100 = 800 stored
        assert [b.exists(f"k{i}") for i in range(11)] == [True, False, False] + [True] * 8
        stats = b.stats()
        assert (stats["evictions"], stats["evicted_bytes"]) == (2, 200)
        assert stats["bytes"] == 900 == disk_bytes(tmp_path)


def test_a_high_watermark_evicts_behind_the_writes_within_the_bound(tmp_path: Path) -> None:
    value = b"v" * (100 - RECORD_BYTES)  # files of 100 bytes
    with make(tmp_path, max_bytes=1000, low_watermark=0.5, high_watermark=0.8) as b:
        for i in range(30):
            assert b.set(f"k{i}", value)
            assert b.stats()["bytes"] + b.stats()["reserved_bytes"] <= 1000
    # Closing waited for the removals started behind the writes.
    with make(tmp_path, max_bytes=1000, low_watermark=0.5, high_watermark=0.8) as again:
        held = [i for i in range(30) if again.get(f"k{i}") == value]
        assert held == list(range(30 - len(held), 30)), "the newest kept, the oldest evicted"
        assert 500 <= disk_bytes(tmp_path) <= 800


def test_capacity_bound_holds_under_concurrent_writers(tmp_path: Path) -> None:
    max_bytes = 256 * 1024
    with make(tmp_path, max_bytes=max_bytes) as b:
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                rng = np.random.default_rng(t)
                for i in range(80):
                    size = int(rng.integers(1, 16)) * 1024
                    assert b.set(f"t{t}-{i}", bytes([t]) * size)
                    if i % 3 == 0:
                        b.get(f"t{t}-{max(i - 5, 0)}")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        on_disk = files_under(tmp_path)
        stats = b.stats()
        assert disk_bytes(tmp_path) <= max_bytes
        assert stats["bytes"] == disk_bytes(tmp_path)
        assert stats["objects"] == len(on_disk)
        assert stats["reserved_bytes"] == 0
        assert stats["evictions"] > 0
        for name in on_disk:  # every survivor is complete and intact
            t = int(name[1 : name.index("-")])
            value = b.get(name)
            assert value is not None and value == bytes([t]) * len(value)


# -- ownership ----------------------------------------------------------------------------------


def rank_keys(deployment: Deployment, n: int) -> list[str]:
    scheme = deployment.rank_suffix()
    return [scheme.key(hashlib.sha256(bytes([i])).hexdigest()) for i in range(n)]


def test_rank_ownership_clear_leaves_other_ranks(tmp_path: Path) -> None:
    rank0, rank1 = Deployment(tp_rank=0, tp_size=2), Deployment(tp_rank=1, tp_size=2)
    keys0, keys1 = rank_keys(rank0, 5), rank_keys(rank1, 5)
    b0 = make(tmp_path, rank0, ownership="rank")
    b1 = make(tmp_path, rank1, ownership="rank")
    b0.batch_set(keys0, [b"0"] * 5)
    b1.batch_set(keys1, [b"1"] * 5)
    b0.set("not-a-rank-key", b"x")
    assert b0.stats()["objects"] == 5
    b0.clear()
    assert b0.batch_exists(keys0[:1]) == 0
    assert b1.batch_exists(keys1) == 5
    assert b0.exists("not-a-rank-key")
    reopened = make(tmp_path, rank1, ownership="rank")
    assert reopened.stats()["objects"] == 5
    for b in (b0, b1, reopened):
        b.close()


def test_rank_ownership_never_evicts_other_ranks(tmp_path: Path) -> None:
    rank0, rank1 = Deployment(tp_rank=0, tp_size=2), Deployment(tp_rank=1, tp_size=2)
    keys0, keys1 = rank_keys(rank0, 20), rank_keys(rank1, 5)
    with make(tmp_path, rank1, ownership="rank") as b1:
        b1.batch_set(keys1, [b"1" * 100] * 5)
    with make(tmp_path, rank0, ownership="rank", max_bytes=500) as b0:
        assert b0.batch_set(keys0, [b"0" * 100] * 20) == [True] * 20
        assert b0.stats()["bytes"] <= 500
        assert b0.exists(keys0[-1])
        assert all(b0.exists(k) for k in keys1)


def test_all_ownership_clears_everything(tmp_path: Path) -> None:
    rank1 = Deployment(tp_rank=1, tp_size=2)
    with make(tmp_path, rank1, ownership="rank") as b1:
        b1.batch_set(rank_keys(rank1, 3), [b"1"] * 3)
    with make(tmp_path) as b:
        assert b.stats()["objects"] == 3
        b.clear()
    assert files_under(tmp_path) == {}


# -- zero-copy page I/O -------------------------------------------------------------------------


def make_pool(kind: str, layout: str, pages: int = 8, page_size: int = 4) -> HostKVPool:
    if kind == "mha":
        return MHAHostPool(
            pages * page_size, page_size, 3, 2, 8, torch.bfloat16, layout, pin_memory=False
        )
    return MLAHostPool(
        pages * page_size, page_size, 3, 24, torch.bfloat16, layout, pin_memory=False
    )


def fill(pool: HostKVPool, value: int | None) -> None:
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    if value is None:
        gen = torch.Generator().manual_seed(1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    else:
        flat.fill_(value)


def pool_bytes(pool: HostKVPool) -> bytes:
    return pool.kv_buffer.view(-1).view(torch.uint8).numpy().tobytes()


def page_of(pool: HostKVPool, page: int) -> bytearray:
    obj = bytearray(pool.page_nbytes)
    pool.read_page(page * pool.page_size, obj)
    return obj


def indices(pool: HostKVPool, pages: list[int]) -> torch.Tensor:
    size = pool.page_size
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_v1_round_trip_between_pools(backend: FileBackend, kind: str, layout: str) -> None:
    source, target, expected = (make_pool(kind, layout) for _ in range(3))
    fill(source, None)
    fill(target, SENTINEL)
    fill(expected, SENTINEL)
    keys = ["p0", "p1", "p2"]
    src_pages, dst_pages = [0, 2, 7], [5, 3, 1]

    backend.register_host_pool(source)
    assert backend.batch_set_v1(keys, indices(source, src_pages)) == [True] * 3
    page = source.page_nbytes
    for key, p in zip(keys, src_pages, strict=True):
        obj = bytearray(page)
        source.read_page(p * source.page_size, obj)
        assert backend.get(key) == bytes(obj)  # same bytes as the generic path stores

    backend.register_host_pool(target)
    assert backend.batch_get_v1([*keys, "absent"], indices(target, [*dst_pages, 6])) == [
        True,
        True,
        True,
        False,
    ]
    for s, d in zip(src_pages, dst_pages, strict=True):
        obj = bytearray(page)
        source.read_page(s * source.page_size, obj)
        expected.write_page(d * expected.page_size, obj)
    assert pool_bytes(target) == pool_bytes(expected)


def test_v1_read_size_mismatch_leaves_page_untouched(backend: FileBackend) -> None:
    pool = make_pool("mha", "layer_first")
    fill(pool, SENTINEL)
    backend.register_host_pool(pool)
    backend.set("short", b"x" * (pool.page_nbytes - 1))
    backend.set("long", b"x" * (pool.page_nbytes + 1))
    assert backend.batch_get_v1(["short", "long"], indices(pool, [0, 1])) == [False, False]
    assert set(pool_bytes(pool)) == {SENTINEL}


def test_v1_first_value_wins(backend: FileBackend) -> None:
    pool = make_pool("mla", "page_first")
    fill(pool, None)
    backend.register_host_pool(pool)
    backend.set("p", b"z" * pool.page_nbytes)
    assert backend.batch_set_v1(["p"], indices(pool, [0])) == [True]
    assert backend.get("p") == b"z" * pool.page_nbytes


def test_v1_without_pool(backend: FileBackend) -> None:
    with pytest.raises(PoolNotRegisteredError):
        backend.batch_get_v1(["k"], list(range(4)))
    with pytest.raises(PoolNotRegisteredError):
        backend.batch_set_v1(["k"], list(range(4)))


def test_v1_misaligned_indices(backend: FileBackend) -> None:
    pool = make_pool("mha", "page_first")
    backend.register_host_pool(pool)
    with pytest.raises(IndexAlignmentError):
        backend.batch_set_v1(["k"], list(range(2, 6)))
    with pytest.raises(IndexAlignmentError):
        backend.batch_get_v1(["k"], list(range(3)))
    with pytest.raises(IndexAlignmentError):
        backend.batch_get_v1(["a", "b"], list(range(4)))


def test_v1_respects_capacity(tmp_path: Path) -> None:
    pool = make_pool("mha", "layer_first")
    fill(pool, None)
    with make(tmp_path, max_bytes=3 * pool.page_nbytes) as b:
        b.register_host_pool(pool)
        keys = [f"p{i}" for i in range(8)]
        assert b.batch_set_v1(keys, indices(pool, list(range(8)))) == [True] * 8
        assert disk_bytes(tmp_path) <= 3 * pool.page_nbytes
        assert b.exists("p7")


# -- config, plugin, baseline -------------------------------------------------------------------


def test_config_defaults() -> None:
    config = FileConfig(root="/tmp/x")
    assert (config.fsync, config.fanout, config.metadata_cache) == (False, None, True)
    assert (config.use_fanout, config.use_integrity, config.naming) == (True, True, "hicache")
    assert (config.max_bytes, config.low_watermark, config.ownership) == (None, 0.9, "all")


@pytest.mark.parametrize(
    "options",
    [
        {"max_bytes": 0},
        {"max_bytes": -5},
        {"low_watermark": 0.0},
        {"low_watermark": 1.0},
        {"metadata_ttl_s": -1.0},
        {"stale_temp_s": -1.0},
        {"ownership": "everyone"},
        {"root": ""},
        {"bogus": 1},
        {"fsync": "yes"},
    ],
)
def test_config_validation(options: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"root": "/tmp/x", **options}, FileConfig)


def test_config_direct_validation() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        FileConfig(root="/tmp/x", max_bytes=0)
    with pytest.raises(ValueError, match="low_watermark"):
        FileConfig(root="/tmp/x", low_watermark=1.5)
    with pytest.raises(ValueError, match="high_watermark"):
        FileConfig(root="/tmp/x", low_watermark=0.9, high_watermark=0.8)
    with pytest.raises(ValueError, match="high_watermark"):
        FileConfig(root="/tmp/x", high_watermark=1.0)
    with pytest.raises(TypeError, match="high_watermark"):
        FileConfig(root="/tmp/x", high_watermark=True)  # type: ignore[arg-type]


def test_fsync_mode(tmp_path: Path) -> None:
    with make(tmp_path, fsync=True) as b:
        assert b.set("k", b"durable")
        assert b.get("k") == b"durable"


def test_plugin_spec() -> None:
    from hicache_storage.backends.file import plugin

    assert plugin.hicache_backends() == [plugin.SPEC]
    spec = plugin.SPEC
    assert spec.name == "file"
    assert spec.load_factory() is FileBackend
    assert spec.load_config_type() is FileConfig
    assert spec.load_baseline() is RawDiskBaseline


def test_baseline_round_trip(tmp_path: Path) -> None:
    for fsync in (False, True):
        baseline = RawDiskBaseline(FileConfig(root=str(tmp_path), fsync=fsync), Deployment())
        values = [payload(1000, seed=i) for i in range(3)]
        names = ["a", "b", "c"]
        baseline.batch_write(names, [memoryview(v) for v in values])
        outs = [memoryview(bytearray(1000)) for _ in names]
        baseline.batch_read(names, outs)
        assert [bytes(o) for o in outs] == values
        with pytest.raises(BufferSizeError):
            baseline.batch_read(["a"], [memoryview(bytearray(1001))])
        baseline.close()
        baseline.close()
        assert not (tmp_path / ".raw-baseline").exists()
