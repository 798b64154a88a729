"""Mooncake-specific behaviour against the session's real master: zero-copy, prefixes, sizes."""

from __future__ import annotations

import secrets
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backends.mooncake.backend import (
    MooncakeBackend,
    capabilities_for,
    clear_pattern,
    unique_rounds,
)
from hicache_storage.backends.mooncake.config import MooncakeConfig
from hicache_storage.backends.mooncake.plugin import SPEC
from hicache_storage.errors import BackendUnavailableError, InvalidKeyError
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool
from hicache_storage.kit.services import free_port

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def big_pool(kind: str, layout: str) -> HostKVPool:
    """Eight pages of 64 KiB, so a bounce copy of one page would stand out."""
    if kind == "mha":
        return MHAHostPool(64, 8, 4, 4, 128, dtype=torch.bfloat16, layout=layout, pin_memory=False)
    return MLAHostPool(64, 8, 4, 1024, dtype=torch.bfloat16, layout=layout, pin_memory=False)


def indices(pool: HostKVPool, pages: list[int]) -> list[int]:
    return [t for p in pages for t in range(p * pool.page_size, (p + 1) * pool.page_size)]


def raw(pool: HostKVPool) -> torch.Tensor:
    return pool.kv_buffer.view(-1).view(torch.uint8)


class Recorder:
    """Stands between the backend and its real store client and records the transfer calls."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.store, name)
        if not name.startswith(("batch_put", "batch_get", "put", "get")):
            return target

        def record(*args: Any) -> Any:
            self.calls.append((name, args))
            return target(*args)

        return record


@pytest.fixture
def bare(options: dict[str, object]) -> Iterator[MooncakeBackend]:
    backend = MooncakeBackend(MooncakeConfig(**options))  # type: ignore[arg-type]
    yield backend
    backend.clear()
    backend.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_hands_mooncake_the_pools_own_buffers(
    bare: MooncakeBackend, kind: str, layout: str
) -> None:
    pool = big_pool(kind, layout)
    raw(pool).copy_(torch.randint(0, 256, raw(pool).shape, dtype=torch.uint8))
    bare.register_host_pool(pool)
    client = bare._client
    recorder = Recorder(client.store)
    client.store = recorder
    keys = ["z0", "z1", "z2"]
    try:
        tracemalloc.start()
        stored = bare.batch_set_v1(keys, indices(pool, [1, 4, 6]))
        before = raw(pool).clone()
        raw(pool)[:] = 0xA5
        tracemalloc.reset_peak()
        loaded = bare.batch_get_v1(keys, indices(pool, [1, 4, 6]))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        client.store = recorder.store
    assert stored == [True] * 3 and loaded == [True] * 3
    meta = pool.page_buffer_meta(indices(pool, [1, 4, 6]))
    ptrs = [[address for address, _ in page] for page in meta]
    sizes = [[nbytes for _, nbytes in page] for page in meta]
    assert [name for name, _ in recorder.calls] == [
        "batch_put_from_multi_buffers",
        "batch_get_into_multi_buffers",
    ]
    for _, (names, got_ptrs, got_sizes) in recorder.calls:
        assert names == [f"{bare._prefix}/{key}" for key in keys]
        assert got_ptrs == ptrs and got_sizes == sizes
    start = pool.kv_buffer.data_ptr()
    end = start + raw(pool).numel()
    assert all(start <= p < end for page in ptrs for p in page)
    assert bare.stats()["registered_bytes"] >= raw(pool).numel()
    assert peak < pool.page_nbytes, f"a {peak}-byte allocation during the v1 load"
    for page in (1, 4, 6):  # the loaded pages are back; the rest still holds the canary
        cols = pool.get_data_page(page * pool.page_size)
        assert torch.equal(cols.view(-1).view(torch.uint8), _page_bytes(before, pool, page))


def _page_bytes(snapshot: torch.Tensor, pool: HostKVPool, page: int) -> torch.Tensor:
    copy = big_pool("mha" if not pool.is_mla else "mla", pool.layout.value)
    raw(copy).copy_(snapshot)
    return copy.get_data_page(page * pool.page_size).view(-1).view(torch.uint8)


def test_v1_object_larger_than_page_is_refused_page_untouched(bare: MooncakeBackend) -> None:
    pool = big_pool("mha", "page_first")
    raw(pool).fill_(0x5A)
    assert bare.set("big", b"x" * (pool.page_nbytes + 1))
    bare.register_host_pool(pool)
    assert bare.batch_get_v1(["big"], indices(pool, [2])) == [False]
    assert bool((raw(pool) == 0x5A).all())
    assert bare.stats()["errors"].get("size_mismatch") == 1


def test_batch_get_larger_value_refused_not_truncated(bare: MooncakeBackend) -> None:
    assert bare.set("v", b"abcdef")
    out = bytearray(b"\x00" * 4)
    assert bare.batch_get(["v"], [out]) == [False]
    assert out == bytearray(4)


def test_values_beyond_the_staging_buffer(options: dict[str, object]) -> None:
    backend = create_backend("mooncake", {**options, "local_buffer_size": "4KiB"})
    try:
        values = [bytes([i]) * (3000 + 2000 * i) for i in range(4)]  # 3 KB .. 9 KB
        keys = [f"s{i}" for i in range(4)]
        assert backend.batch_set(keys, values) == [True] * 4
        outs = [bytearray(len(v)) for v in values]
        assert backend.batch_get(keys, outs) == [True] * 4
        assert [bytes(o) for o in outs] == values
        assert backend.get("s3") == values[3]
        backend.clear()
    finally:
        backend.close()


def test_repeated_key_in_one_batch_fills_every_destination(bare: MooncakeBackend) -> None:
    assert unique_rounds(["a", "b", "a", "a", "c"]) == [[0, 1, 4], [2], [3]]
    assert bare.batch_set(["a", "a"], [b"first", b"other"]) == [True, True]
    outs = [bytearray(5), bytearray(5), bytearray(5)]
    assert bare.batch_get(["a", "a", "a"], outs) == [True, True, True]
    assert outs == [bytearray(b"first")] * 3


def test_clear_pattern_matches_one_namespace() -> None:
    assert clear_pattern("a.b") == r"^a\.b/[^/]+$"
    assert clear_pattern("ten/sub") == "^ten/sub/[^/]+$"
    assert clear_pattern("") == "^[^/]+$"


NESTED = [
    ("ten{t}", "ten{t}2"),
    ("ten{t}", "ten{t}/sub"),
    ("", "ten{t}"),
    ("ten{t}/", "ten{t}2/"),
    ("a.b{t}", "aXb{t}"),  # '.' must not match any character in clear()'s regex
]


@pytest.mark.parametrize(("short", "long"), NESTED)
def test_nested_namespaces_never_see_or_clear_each_other(
    options: dict[str, object], short: str, long: str
) -> None:
    """One prefix a prefix of the other: no shared names, and clear() touches only its own."""
    token = secrets.token_hex(3)  # keeps this test's names apart from every other test's
    short, long = short.format(t=token), long.format(t=token)
    a = create_backend("mooncake", {**options, "prefix": short})
    b = create_backend("mooncake", {**options, "prefix": long})
    tail = long.removeprefix(short).strip("/")  # what a join without a separator would share
    try:
        # "ten" + "2k" and "ten2" + "k" would be one object if names were concatenated.
        assert a.set(f"{tail}k", b"A-joined") if tail else True
        assert a.set("k", b"A") and b.set("k", b"B")
        assert a.get("k") == b"A" and b.get("k") == b"B"
        assert not b.exists(f"{tail}k") if tail else True
        assert b.batch_exists(["k", "only-a"]) == 1 and a.batch_exists(["only-b"]) == 0
        assert b.set("only-b", b"b") and a.set("only-a", b"a")
        a.clear()
        assert a.batch_exists(["k"]) == 0 and not a.exists("only-a")
        assert b.get("k") == b"B" and b.exists("only-b"), f"clear() of {short!r} hit {long!r}"
        assert a.set("k", b"A2")
        b.clear()
        assert not b.exists("k") and not b.exists("only-b")
        assert a.get("k") == b"A2", f"clear() of {long!r} hit {short!r}"
    finally:
        a.clear()
        b.clear()
        a.close()
        b.close()


def test_bare_backend_refuses_a_key_with_the_separator(bare: MooncakeBackend) -> None:
    with pytest.raises(InvalidKeyError, match="'/'"):
        bare.set("sub/k", b"x")
    with pytest.raises(InvalidKeyError):
        bare.batch_exists(["ok", "a/b"])


def test_capabilities_follow_the_segment_option(options: dict[str, object]) -> None:
    pure = MooncakeConfig(master="m:1").resolve(env={})
    assert capabilities_for(pure) == SPEC.capabilities  # the documented default
    assert capabilities_for(pure).persistent and capabilities_for(pure).shared
    mounting = MooncakeConfig(master="m:1", global_segment_size="1GB").resolve(env={})
    caps = capabilities_for(mounting)
    assert not caps.persistent and not caps.shared
    assert caps.native_zero_copy and caps.delete and caps.crash_safe_writes
    with create_backend("mooncake", options) as backend:
        assert backend.capabilities == SPEC.capabilities


def test_data_outlives_the_writing_instance(options: dict[str, object]) -> None:
    with create_backend("mooncake", options) as writer:
        assert writer.set("kept", b"survives close")
    with create_backend("mooncake", options) as reader:
        assert reader.get("kept") == b"survives close"
        assert reader.delete("kept") is True and reader.delete("kept") is False


def _build_in_thread(options: dict[str, object]) -> BaseException | None:
    """Build a backend in a thread; return its error (a hang shows as the thread still alive)."""
    outcome: list[BaseException | None] = []

    def build() -> None:
        try:
            MooncakeBackend(MooncakeConfig(**options)).close()  # type: ignore[arg-type]
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(30)  # setup() without a master would block about 90 s
    assert not thread.is_alive(), "building the backend hung without a master"
    return outcome[0]


def test_unreachable_master_is_a_clear_error_not_a_hang() -> None:
    address = f"127.0.0.1:{free_port()}"
    error = _build_in_thread({"master": address, "global_segment_size": 0})
    assert isinstance(error, BackendUnavailableError)
    assert address in str(error) and "not reachable" in str(error)


def test_unroutable_master_fails_within_the_probe_timeout() -> None:
    options = {"master": "10.255.255.1:50051", "global_segment_size": 0, "probe_timeout_s": 0.5}
    error = _build_in_thread(options)
    assert isinstance(error, BackendUnavailableError) and "10.255.255.1:50051" in str(error)


def test_missing_master_config_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_storage.errors import ConfigError

    for name in ("MOONCAKE_MASTER", "MOONCAKE_CONFIG_PATH", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="MOONCAKE_MASTER"):
        create_backend("mooncake", {})


class Slow:
    """Stands between the backend and its store client; each put takes ``delay`` seconds."""

    def __init__(self, store: Any, delay: float) -> None:
        self.store = store
        self.delay = delay

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.store, name)
        if name != "batch_put_from":
            return target

        def slow(*args: Any) -> Any:
            time.sleep(self.delay)
            return target(*args)

        return slow


def test_a_call_starts_no_request_its_deadline_cannot_cover(options: dict[str, object]) -> None:
    """Four values, one staged put each: after a slow first put, the rest do not fit."""
    backend = MooncakeBackend(
        MooncakeConfig(**{**options, "local_buffer_size": "4KiB", "deadline_s": 2.0})  # type: ignore[arg-type]
    )
    client = backend._client
    put_cost = client.timeouts.cost("put")  # 1.75 s of the 2 s deadline
    client.store = Slow(client.store, delay=2.0 - put_cost + 0.05)
    try:
        start = time.monotonic()
        stored = backend.batch_set(
            [f"d{i}" for i in range(4)], [bytes([i]) * 3000 for i in range(4)]
        )
        took = time.monotonic() - start
    finally:
        client.store = client.store.store
    assert stored == [True, False, False, False]
    assert took < 1.0 and backend.stats()["errors"]["deadline_exceeded"] == 3
    backend.clear()
    backend.close()
