"""Every contract method on every built-in backend, through the default layers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hicache_storage import (
    BackendClosedError,
    BatchMismatchError,
    BufferSizeError,
    HostPoolError,
    IndexAlignmentError,
    InvalidKeyError,
    InvalidValueError,
    PoolNotRegisteredError,
    StorageBackend,
    create_backend,
)
from hicache_storage.backends.memory import MemoryBackend

from .helpers import LAYOUTS, make_pool

SENTINEL = 0xA5


def payload(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [1, 7, 4096, 3 * 1024 * 1024 + 5])
def test_set_get_round_trip(backend: StorageBackend, size: int) -> None:
    value = payload(size, size)
    assert backend.set(f"k{size}", value)
    got = backend.get(f"k{size}")
    assert got is not None
    assert hashlib.sha256(bytes(got)).digest() == hashlib.sha256(value).digest()
    out = bytearray(size)
    assert backend.get(f"k{size}", out) is out
    assert bytes(out) == value


def test_miss_is_a_value(backend: StorageBackend) -> None:
    assert backend.get("absent") is None
    assert backend.get("absent", bytearray(4)) is None
    assert backend.exists("absent") is False
    assert backend.batch_exists(["absent", "also-absent"]) == 0


@pytest.mark.parametrize(
    "value",
    [
        b"abcd",
        bytearray(b"abcd"),
        memoryview(b"abcd"),
        np.frombuffer(b"abcd", dtype=np.uint8),
        torch.tensor([0x64636261], dtype=torch.int32),
    ],
    ids=["bytes", "bytearray", "memoryview", "numpy", "torch"],
)
def test_value_types(backend: StorageBackend, value: object) -> None:
    assert backend.set("typed", value)  # type: ignore[arg-type]
    assert bytes(backend.get("typed")) == b"abcd"  # type: ignore[arg-type]
    out = torch.zeros(4, dtype=torch.uint8)
    assert backend.get("typed", out) is out  # type: ignore[arg-type]
    assert bytes(out.numpy()) == b"abcd"


def test_non_contiguous_values_refused(backend: StorageBackend) -> None:
    strided = np.arange(16, dtype=np.uint8)[::2]
    with pytest.raises(InvalidValueError):
        backend.set("k", strided)
    with pytest.raises(InvalidValueError):
        backend.set("k", torch.arange(16).reshape(4, 4).t())  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError):
        backend.set("k", "a string")  # type: ignore[arg-type]
    assert not backend.exists("k")


def test_first_complete_value_wins(backend: StorageBackend) -> None:
    assert backend.set("k", b"first")
    assert backend.set("k", b"second")
    assert bytes(backend.get("k")) == b"first"  # type: ignore[arg-type]


def test_wrong_sized_buffer_refused_and_untouched(backend: StorageBackend) -> None:
    backend.set("k", b"12345678")
    for size in (7, 9):
        out = bytearray(b"\xee" * size)
        with pytest.raises(BufferSizeError):
            backend.get("k", out)
        assert out == bytearray(b"\xee" * size)
    with pytest.raises(InvalidValueError):
        backend.get("k", b"\x00" * 8)


def test_batch_calls(backend: StorageBackend) -> None:
    keys = [f"b{i}" for i in range(40)]
    values = [payload(i, 100 + i) for i in range(40)]
    assert backend.batch_set(keys, values) == [True] * 40
    outs = [bytearray(len(v)) for v in values]
    assert backend.batch_get(keys, outs) == [True] * 40
    assert [bytes(o) for o in outs] == values
    assert backend.batch_set([], []) == []
    assert backend.batch_get([], []) == []
    assert backend.batch_exists([]) == 0
    mixed = ["b0", "nope", "b1"]
    assert backend.batch_get(mixed, [bytearray(100), bytearray(1), bytearray(101)]) == [
        True,
        False,
        True,
    ]
    with pytest.raises(BatchMismatchError):
        backend.batch_set(["x", "y"], [b"1"])
    with pytest.raises(BatchMismatchError):
        backend.batch_get(["x"], [])


def test_batch_get_wrong_size_is_a_miss_for_that_key(backend: StorageBackend) -> None:
    backend.batch_set(["a", "b"], [b"aa", b"bbb"])
    outs = [bytearray(2), bytearray(2)]
    assert backend.batch_get(["a", "b"], outs) == [True, False]
    assert outs[1] == bytearray(2)


def test_batch_exists_counts_the_leading_run(backend: StorageBackend) -> None:
    backend.batch_set(["p0", "p1", "p3"], [b"0", b"1", b"3"])
    assert backend.batch_exists(["p0", "p1", "p2", "p3"]) == 2
    assert backend.batch_exists(["p2", "p0"]) == 0
    assert backend.batch_exists(["p0", "p1", "p3"]) == 3
    assert backend.batch_exists(["p0", "p0"]) == 2


def test_delete_and_clear(backend: StorageBackend) -> None:
    backend.batch_set(["d0", "d1", "d2"], [b"0", b"1", b"2"])
    assert backend.delete("d0") is True
    assert backend.delete("d0") is False
    assert not backend.exists("d0")
    assert backend.get("d0") is None
    backend.clear()
    assert backend.batch_exists(["d1"]) == 0
    assert backend.set("d1", b"again")
    assert bytes(backend.get("d1")) == b"again"  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["", "../x", "a/../b", "a/b", "..", "a\x00b", ".hidden", "é"])
def test_invalid_keys_refused_everywhere(backend: StorageBackend, key: str) -> None:
    for call in (
        lambda: backend.get(key),
        lambda: backend.exists(key),
        lambda: backend.set(key, b"v"),
        lambda: backend.delete(key),
        lambda: backend.batch_exists(["ok", key]),
        lambda: backend.batch_set(["ok", key], [b"1", b"2"]),
    ):
        with pytest.raises(InvalidKeyError):
            call()
    assert not backend.exists("ok")


def test_use_after_close_and_double_close(backend: StorageBackend) -> None:
    backend.set("k", b"v")
    backend.close()
    backend.close()
    assert backend.closed
    for call in (
        lambda: backend.get("k"),
        lambda: backend.exists("k"),
        lambda: backend.set("k", b"v"),
        lambda: backend.batch_exists(["k"]),
    ):
        with pytest.raises(BackendClosedError):
            call()
    assert backend.stats()["backend"] in ("memory", "file")


def test_context_manager_closes(make_backend: Callable[..., StorageBackend]) -> None:
    with make_backend() as backend:
        backend.set("k", b"v")
    assert backend.closed


def test_stats_agree_with_operations(backend: StorageBackend) -> None:
    backend.set("s0", b"abc")
    backend.get("s0")
    backend.get("s1")
    backend.batch_exists(["s0", "s1", "s0"])
    ops = backend.stats()["metrics"]["ops"]
    assert ops["set"]["ok"] == 1
    assert (ops["get"]["hit"], ops["get"]["miss"]) == (1, 1)
    assert (ops["batch_exists"]["hit"], ops["batch_exists"]["miss"]) == (1, 2)
    assert backend.stats()["metrics"]["bytes_read"] == 3
    assert backend.stats()["metrics"]["bytes_written"] == 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_zero_copy_round_trip_with_canaries(
    backend: StorageBackend, kind: str, layout: str
) -> None:
    pool = make_pool(kind, layout)
    page = pool.page_size
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    backend.register_host_pool(pool)
    keys = [f"{kind}-{layout}-{i}" for i in range(3)]
    src_pages, dst_pages = [1, 4, 6], [7, 0, 3]
    originals = [pool.get_data_page(p * page).view(torch.uint8) for p in src_pages]
    src = [i for p in src_pages for i in range(p * page, (p + 1) * page)]
    dst = torch.tensor([i for p in dst_pages for i in range(p * page, (p + 1) * page)])
    assert backend.batch_set_v1(keys, src) == [True] * 3

    raw.fill_(SENTINEL)
    hits = backend.batch_get_v1([*keys, "missing"], torch.cat([dst, torch.arange(page)]))
    assert hits == [True, True, True, False]
    touched = torch.zeros_like(raw, dtype=torch.bool)
    for original, d in zip(originals, dst_pages, strict=True):
        assert torch.equal(pool.get_data_page(d * page).view(torch.uint8), original)
        for views in pool.page_buffer_views(range(d * page, (d + 1) * page)):
            for view in views:
                start = np.frombuffer(view, dtype=np.uint8).ctypes.data - raw.data_ptr()
                touched[start : start + len(view)] = True
    assert int(touched.sum()) == 3 * pool.page_nbytes
    assert bool((raw[~touched] == SENTINEL).all()), "bytes outside the loaded pages changed"


def test_zero_copy_refuses_bad_requests(backend: StorageBackend) -> None:
    pool = make_pool("mha", "page_first")
    with pytest.raises(PoolNotRegisteredError):
        backend.batch_get_v1(["k"], list(range(4)))
    backend.register_host_pool(pool)
    with pytest.raises(IndexAlignmentError):
        backend.batch_set_v1(["k"], list(range(1, 5)))
    with pytest.raises(IndexAlignmentError):
        backend.batch_set_v1(["k", "j"], list(range(4)))
    with pytest.raises(IndexAlignmentError):
        backend.batch_get_v1(["k"], list(range(1000, 1004)))
    assert not backend.exists("k")


def test_zero_copy_size_mismatch_is_a_miss(backend: StorageBackend) -> None:
    pool = make_pool("mla", "page_first")
    backend.register_host_pool(pool)
    backend.set("short", b"x" * (pool.page_nbytes - 1))
    before = pool.kv_buffer.clone()
    assert backend.batch_get_v1(["short"], list(range(4))) == [False]
    assert torch.equal(pool.kv_buffer, before)


@pytest.mark.parametrize("pool", [object(), None, "pool", 42])
def test_register_host_pool_refuses_what_is_not_a_pool(pool: object) -> None:
    """Issue 14 item 8: refused at registration, not with an AttributeError at the next v1 call."""
    with create_backend("memory") as backend:
        with pytest.raises(HostPoolError, match="host pool"):
            backend.register_host_pool(pool)  # type: ignore[arg-type]
        with pytest.raises(PoolNotRegisteredError):
            backend.batch_get_v1(["k"], list(range(4)))
    bare = MemoryBackend()
    with pytest.raises(HostPoolError):
        bare.register_host_pool(pool)  # type: ignore[arg-type]
