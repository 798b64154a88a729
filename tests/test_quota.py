"""Namespace quotas: a ledger shared by every writer bounds a namespace's bytes, tenants apart."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hicache_storage import StorageBackend, create_backend, open_backend
from hicache_storage.config import LayerConfig, QuotaConfig, load_config
from hicache_storage.errors import BackendUnavailableError, ConfigError
from hicache_storage.layers import QuotaLayer
from hicache_storage.quota import SQLiteLedger

from .helpers import make_pool, page_indices

VALUE = 256 * 1024
QUOTA = 16 * VALUE


def _backend(root: Path, quota: int = QUOTA, **options: object) -> StorageBackend:
    layers = LayerConfig(quota=QuotaConfig(bytes=quota))
    return create_backend("file", {"root": str(root), **options}, layers=layers)


def _disk_values(root: Path) -> int:
    """Bytes of the values stored under ``root`` (objects less their integrity records)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            if name.startswith("."):
                continue
            try:
                total += os.path.getsize(os.path.join(directory, name)) - 32
            except FileNotFoundError:
                continue
    return total


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
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _disk_values(root))

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
