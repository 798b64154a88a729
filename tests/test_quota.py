"""Namespace quotas: a ledger shared by every writer bounds a namespace's bytes, tenants apart."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache_storage import StorageBackend, create_backend, open_backend
from hicache_storage.config import LayerConfig, QuotaConfig, load_config
from hicache_storage.errors import BackendIOError, BackendUnavailableError, ConfigError
from hicache_storage.layers import ForwardingBackend, QuotaLayer
from hicache_storage.layers.verify import RECORD_PREFIX
from hicache_storage.quota import SQLiteLedger

from .helpers import make_pool, page_indices

VALUE = 256 * 1024
QUOTA = 16 * VALUE


def _backend(root: Path, quota: int = QUOTA, **options: object) -> StorageBackend:
    layers = LayerConfig(quota=QuotaConfig(bytes=quota))
    return create_backend("file", {"root": str(root), **options}, layers=layers)


def _disk_files(root: Path) -> dict[str, int]:
    """Bytes of each value stored under ``root`` (its object less its integrity record)."""
    sizes: dict[str, int] = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            try:
                sizes[path] = os.path.getsize(path) - 32
            except FileNotFoundError:
                continue
    return sizes


def _disk_values(root: Path) -> int:
    """Bytes of the values stored under ``root``."""
    return sum(_disk_files(root).values())


def _write_many(root: str, writer: int, count: int) -> None:
    backend = _backend(Path(root))
    for i in range(count):
        backend.set(f"w{writer}-{i}", bytes([writer]) * VALUE)
    backend.close()


def test_writers_in_several_processes_never_pass_the_quota_together(tmp_path: Path) -> None:
    root = tmp_path / "tenant"
    _backend(root).close()
    peak = 0
    done = threading.Event()

    def watch() -> None:
        # One walk is no snapshot: it can count a file deleted early in the walk and one
        # written after it, in a directory walked later. Each key is written once and never
        # again once evicted, so a file seen by two walks in a row was on disk from the first
        # to the second: the files two walks share were all there at once, between them.
        nonlocal peak
        seen = _disk_files(root)
        while not done.is_set():
            now = _disk_files(root)
            peak = max(peak, sum(size for path, size in now.items() if path in seen))
            seen = now

    watcher = threading.Thread(target=watch)
    watcher.start()
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(root), w, 40)) for w in range(4)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    done.set()
    watcher.join()
    assert 0 < peak <= QUOTA + VALUE
    backend = _backend(root)
    quota = backend.stats()["quota"]
    assert quota["used_bytes"] == _disk_values(root) <= QUOTA
    assert quota["held_bytes"] == 0
    stored = [k for w in range(4) for k in (f"w{w}-{i}" for i in range(40)) if backend.exists(k)]
    assert len(stored) == quota["pages"] and stored  # the ledger and the disk agree
    backend.close()


def test_a_tenant_filling_its_quota_evicts_only_its_own_pages(tmp_path: Path) -> None:
    quiet = _backend(tmp_path / "quiet")
    loud = _backend(tmp_path / "loud")
    for i in range(8):
        assert quiet.set(f"q{i}", bytes([i]) * VALUE)
    for i in range(100):
        assert loud.set(f"l{i}", bytes([i % 256]) * VALUE)
    assert all(quiet.get(f"q{i}") == bytes([i]) * VALUE for i in range(8))
    assert loud.stats()["quota"]["evicted_pages"] >= 100 - 16
    assert _disk_values(tmp_path / "loud") <= QUOTA
    loud.clear()
    assert quiet.exists("q0") and quiet.stats()["quota"]["pages"] == 8
    assert loud.stats()["quota"]["pages"] == 0
    quiet.close()
    loud.close()


def test_the_least_recently_read_pages_go_first(tmp_path: Path) -> None:
    backend = _backend(tmp_path, metadata_cache=False)
    for i in range(16):
        backend.set(f"k{i}", bytes(VALUE))
    assert backend.get("k0") is not None  # read: now the most recently used
    for i in range(16, 20):
        backend.set(f"k{i}", bytes(VALUE))
    assert backend.exists("k0")
    assert not backend.exists("k1")
    backend.close()


def test_a_batch_past_the_quota_stores_its_leading_pages_and_sheds_the_rest(
    tmp_path: Path,
) -> None:
    backend = _backend(tmp_path, quota=4 * VALUE)
    flags = backend.batch_set([f"k{i}" for i in range(6)], [bytes(VALUE)] * 6)
    assert flags == [True] * 4 + [False] * 2
    assert backend.stats()["quota"]["shed_pages"] == 2
    assert not backend.set("big", bytes(5 * VALUE))  # larger than the quota: never stored
    assert backend.exists("k0")
    backend.close()


def test_pool_pages_count_against_the_quota(tmp_path: Path) -> None:
    pool = make_pool("mha", "page_first", pages=8)
    pool.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.arange(pool.kv_buffer.numel() * 2, dtype=torch.int64).remainder(251)
    )
    page = pool.page_nbytes
    backend = _backend(tmp_path, quota=3 * page)
    backend.register_host_pool(pool)
    keys = [f"p{i}" for i in range(5)]
    assert backend.batch_set_v1(keys, page_indices(pool, range(5))) == [True] * 3 + [False] * 2
    assert backend.batch_set_v1(keys[3:], page_indices(pool, range(3, 5))) == [True, True]
    quota = backend.stats()["quota"]
    assert quota["used_bytes"] <= 3 * page and quota["evicted_pages"] >= 2
    assert backend.batch_get_v1(keys[3:], page_indices(pool, range(6, 8))) == [True, True]
    backend.close()


def test_delete_gives_the_room_back(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    backend.set("a", bytes(VALUE))
    assert backend.stats()["quota"]["used_bytes"] == VALUE
    assert backend.delete("a")
    assert backend.stats()["quota"]["used_bytes"] == 0
    backend.close()


def test_a_killed_writers_hold_is_forgotten_after_hold_s(tmp_path: Path) -> None:
    ledger = SQLiteLedger(str(tmp_path / "ledger.sqlite"))
    args = {"quota": 10, "target": 9, "hold_s": 60.0}
    assert ledger.reserve(8, now=1000.0, **args) is not None  # never settled: the writer died
    assert ledger.reserve(4, now=1030.0, **args) is None
    grant = ledger.reserve(4, now=1061.0, **args)
    assert grant is not None and not grant.victims
    ledger.settle(grant.hold, [("k", 4)], now=1061.0)
    usage = ledger.usage(now=1061.0)
    assert (usage.used_bytes, usage.held_bytes, usage.pages) == (4, 0, 1)
    ledger.close()


def test_a_ledger_that_does_not_answer_stores_nothing(tmp_path: Path) -> None:
    class Down(SQLiteLedger):
        def reserve(self, nbytes: int, **kwargs: object) -> None:  # type: ignore[override]
            raise BackendUnavailableError("ledger down")

    inner = create_backend("file", {"root": str(tmp_path)}, layers=LayerConfig(stack=()))
    layer = QuotaLayer(
        inner, QuotaConfig(bytes=QUOTA), ledger=Down(str(tmp_path / ".ledger.sqlite"))
    )
    with pytest.raises(BackendUnavailableError):
        layer.set("a", bytes(VALUE))
    assert not inner.exists("a")
    layer.close()


def test_through_degrade_a_ledger_that_stays_locked_is_a_counted_miss(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    blocker = SQLiteLedger(str(tmp_path / ".hicache-quota.sqlite"))
    blocker._db.execute("BEGIN EXCLUSIVE")  # another process holding the ledger too long
    try:
        started = time.monotonic()
        assert backend.set("a", bytes(VALUE)) is False
        assert time.monotonic() - started < 10
        assert sum(backend.stats()["degraded"]["errors"]["set"].values()) == 1
    finally:
        blocker._db.execute("ROLLBACK")
        blocker.close()
    assert backend.set("a", bytes(VALUE))
    backend.close()


def test_a_backend_without_a_ledger_must_be_given_one(tmp_path: Path) -> None:
    layers = LayerConfig(quota=QuotaConfig(bytes=QUOTA))
    with pytest.raises(ConfigError, match=r"layers\.quota\.ledger"):
        create_backend("memory", layers=layers)
    named = LayerConfig(quota=QuotaConfig(bytes=QUOTA, ledger=str(tmp_path / "l.sqlite")))
    backend = create_backend("memory", layers=named)
    assert backend.set("a", bytes(VALUE)) and backend.stats()["quota"]["pages"] == 1
    backend.close()


def test_quota_config_is_checked() -> None:
    with pytest.raises(ValueError, match="bytes"):
        QuotaConfig(bytes=0)
    with pytest.raises(ValueError, match="namespace"):
        QuotaConfig(bytes=1, ledger="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="low_watermark"):
        QuotaConfig(bytes=1, low_watermark=1.0)
    with pytest.raises(ValueError, match="quota"):
        LayerConfig(stack=("degrade", "quota"))


def test_a_quota_comes_from_the_config_the_engines_pass(tmp_path: Path) -> None:
    """SGLang's and vLLM's entry points read a whole config (JSON); a quota is one key of it."""
    config = load_config(
        {
            "backend": "file",
            "options": {"root": str(tmp_path)},
            "layers": {"quota": {"bytes": VALUE}},
        }
    )
    backend = open_backend(config)
    assert backend.set("a", bytes(VALUE)) and backend.set("b", bytes(VALUE))
    assert not backend.exists("a") and backend.stats()["quota"]["pages"] == 1
    backend.close()


def test_a_damaged_ledger_is_a_store_error_and_close_twice_is_quiet(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    backend.set("a", bytes(VALUE))
    (tmp_path / ".hicache-quota.sqlite").write_bytes(b"not a database" * 512)
    assert backend.set("b", bytes(VALUE)) is False  # a counted miss, not an exception
    assert sum(backend.stats()["degraded"]["errors"]["set"].values()) == 1
    backend.close()
    backend.close()


def test_pages_the_quota_evicts_or_deletes_take_their_integrity_records(tmp_path: Path) -> None:
    pool = make_pool("mha", "page_first", pages=4)
    backend = _backend(tmp_path, quota=2 * pool.page_nbytes)
    backend.register_host_pool(pool)
    for i in range(12):
        assert backend.batch_set_v1([f"p{i}"], page_indices(pool, [i % 4])) == [True]
    assert backend.stats()["quota"]["evicted_pages"] >= 10
    assert backend.delete("p11")
    names = [name for _, _, files in os.walk(tmp_path) for name in files if name[0] != "."]
    records = [name for name in names if name.startswith(RECORD_PREFIX)]
    assert len(records) == len(names) - len(records) == backend.stats()["quota"]["pages"]
    backend.close()


class _Races(ForwardingBackend):
    """A store where another writer's page lands just after a delete or a clear of its own."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.landing: Callable[[], object] = lambda: None

    def delete(self, key: str) -> bool:
        existed = self.inner.delete(key)
        self.landing()
        return existed

    def clear(self) -> None:
        self.inner.clear()
        self.landing()


def _racing(root: Path) -> tuple[QuotaLayer, _Races, StorageBackend]:
    """A quota layer over a racing store, and another writer of the same namespace."""
    store = _Races(create_backend("file", {"root": str(root)}, layers=LayerConfig(stack=())))
    return QuotaLayer(store, QuotaConfig(bytes=QUOTA)), store, _backend(root)


def test_a_write_landing_during_a_clear_stays_counted(tmp_path: Path) -> None:
    layer, store, writer = _racing(tmp_path)
    assert layer.set("old", bytes(VALUE))
    store.landing = lambda: writer.set("late", bytes(VALUE))
    layer.clear()
    assert writer.exists("late") and not writer.exists("old")
    quota = writer.stats()["quota"]
    assert (quota["used_bytes"], quota["pages"]) == (VALUE, 1)
    layer.close()
    writer.close()


def test_a_write_landing_during_a_delete_of_its_key_stays_counted(tmp_path: Path) -> None:
    layer, store, writer = _racing(tmp_path)
    assert layer.set("k", bytes(VALUE))
    store.landing = lambda: writer.set("k", bytes(VALUE))
    assert layer.delete("k")
    assert writer.exists("k")
    quota = writer.stats()["quota"]
    assert (quota["used_bytes"], quota["pages"]) == (VALUE, 1)
    layer.close()
    writer.close()


def test_a_delete_that_fails_keeps_the_page_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer, store, writer = _racing(tmp_path)
    writer.close()
    assert layer.set("k", bytes(VALUE))

    def fails(key: str) -> bool:
        raise BackendIOError(f"{key} could not be deleted")

    monkeypatch.setattr(store, "delete", fails)
    with pytest.raises(BackendIOError):
        layer.delete("k")
    assert layer.stats()["quota"]["used_bytes"] == VALUE
    layer.close()


def test_tenants_sharing_an_sqlite_ledger_file_keep_apart_accounts(tmp_path: Path) -> None:
    ledger = str(tmp_path / "shared.sqlite")

    def tenant(name: str | None) -> StorageBackend:
        quota = QuotaConfig(bytes=4 * VALUE, ledger=ledger, namespace=name)
        root = {"root": str(tmp_path / (name or "default"))}
        return create_backend("file", root, layers=LayerConfig(quota=quota))

    a, b, default = tenant("a"), tenant("b"), tenant(None)
    for i in range(4):
        assert b.set(f"b{i}", bytes(VALUE)) and default.set(f"d{i}", bytes(VALUE))
    for i in range(8):
        assert a.set(f"a{i}", bytes(VALUE))
    a.clear()
    for other in (b, default):
        quota = other.stats()["quota"]
        assert (quota["used_bytes"], quota["pages"], quota.get("evicted_pages", 0)) == (
            4 * VALUE,
            4,
            0,
        )
    assert all(b.exists(f"b{i}") for i in range(4))
    for backend in (a, b, default):
        backend.close()


def test_a_key_repeated_in_a_batch_is_stored_and_counted_once(tmp_path: Path) -> None:
    backend = _backend(tmp_path, quota=VALUE + VALUE // 2)
    values = [bytes([1]) * VALUE, bytes([2]) * VALUE]
    assert backend.batch_set(["d", "d"], values) == [True, True]
    assert backend.get("d") == values[1], "the last write wins"
    quota = backend.stats()["quota"]
    assert (quota["used_bytes"], quota["pages"], quota.get("shed_pages", 0)) == (VALUE, 1, 0)
    pool = make_pool("mha", "page_first", pages=4)
    pool.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.arange(pool.kv_buffer.numel() * 2, dtype=torch.int64).remainder(251)
    )
    pages = _backend(tmp_path / "pages", quota=2 * pool.page_nbytes)
    pages.register_host_pool(pool)
    stored = pages.batch_set_v1(["p", "q", "p"], torch.tensor(page_indices(pool, range(3))))
    assert stored == [True] * 3
    assert pages.batch_get_v1(["p"], page_indices(pool, [3])) == [True]
    assert torch.equal(
        pool.get_data_page(3 * pool.page_size), pool.get_data_page(2 * pool.page_size)
    )
    backend.close()
    pages.close()
