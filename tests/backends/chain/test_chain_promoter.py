"""Promotions are stored behind the read: no read waits for them, none outlives a removal."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.backends.chain.promoter import Promoter
from hicache_storage.factory import create_backend
from hicache_storage.hostpool import MHAHostPool

VALUE = 4096
SLOW_WRITE_S = 1.0


def _value(seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(VALUE))


def _slow_first_tier_chain(tmp_path: Path) -> StorageBackend:
    """A chain whose first tier takes ``SLOW_WRITE_S`` to store anything."""
    slow = {"delay_s": SLOW_WRITE_S}
    near: dict[str, Any] = {
        "backend": "file",
        "options": {"root": str(tmp_path / "near")},
        "layers": {"verify": False, "faults": {"ops": {"batch_set": slow, "set": slow}}},
    }
    far = {"backend": "file", "options": {"root": str(tmp_path / "far")}}
    with create_backend("file", far["options"]) as remote:
        assert remote.batch_set(["a", "b"], [_value(1), _value(2)]) == [True, True]
    return create_backend("chain", {"tiers": [near, far]})


def test_a_read_returns_before_its_promotion_is_stored(tmp_path: Path) -> None:
    with _slow_first_tier_chain(tmp_path) as chain:
        assert chain.get("a") == _value(1)
        stats = chain.stats()
        assert stats["promotions"]["queued"] == 1
        assert stats["tiers"][0]["promoted"] == 0, "the read did not wait for the write"
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert chain.stats()["tiers"][0]["promoted"] == 1
        assert chain.stats()["promotions"]["pending"] == 0
        assert chain.get("a") == _value(1)
        assert chain.stats()["tiers"][0]["hits"] == 1, "then served by the first tier"


def test_a_deleted_page_is_never_promoted_after_the_delete_returned(tmp_path: Path) -> None:
    with _slow_first_tier_chain(tmp_path) as chain:
        assert chain.get("a") == _value(1)  # its promotion is being stored, slowly
        assert chain.get("b") == _value(2)  # queued behind it, or in the same round
        assert chain.delete("a") and chain.delete("b")
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert not chain.exists("a") and not chain.exists("b")
        assert chain.get("b") is None


def test_clear_drops_queued_promotions(tmp_path: Path) -> None:
    with _slow_first_tier_chain(tmp_path) as chain:
        assert chain.get("a") == _value(1)
        assert chain.get("b") == _value(2)
        chain.clear()
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert not chain.exists("a") and not chain.exists("b")


def test_promotions_beyond_the_bound_are_shed_and_the_rest_stored() -> None:
    release = threading.Event()
    stored: list[str] = []

    def store(origin: tuple[int, str], keys: list[str], copies: list[bytes]) -> None:
        assert origin == (1, "objects") and all(len(c) == 10 for c in copies)
        release.wait(30.0)
        stored.extend(keys)

    promoter = Promoter(store, max_bytes=30)
    try:
        assert promoter.offer((1, "objects"), ["a"], [b"x" * 10]) == 0
        assert promoter.offer((1, "objects"), ["b", "c", "d", "e"], [b"y" * 10] * 4) in (1, 2)
        release.set()
        assert promoter.flush(30.0)
        counts = promoter.stats()
        assert counts["queued"] == len(stored) and counts["queued"] + counts["shed"] == 5
        assert stored[0] == "a" and counts["pending"] == 0
    finally:
        release.set()
        promoter.close()


def test_close_drops_the_queue_and_stops_the_thread() -> None:
    promoter = Promoter(lambda origin, keys, copies: None)
    promoter.close()
    assert promoter.offer((1, "pages"), ["late"], [b"z"]) == 1, "nothing is queued once closed"
    assert promoter.flush(1.0)


def test_a_zero_copy_read_returns_before_its_promotion_is_stored(tmp_path: Path) -> None:
    pool = MHAHostPool(4 * 64, 64, 32, 8, 128, torch.bfloat16, "layer_first", False)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    indices = torch.arange(64)
    far = {"backend": "file", "options": {"root": str(tmp_path / "far")}}
    with create_backend("file", far["options"]) as remote:
        remote.register_host_pool(pool)
        assert remote.batch_set_v1(["v"], indices) == [True]
    slow = {"delay_s": SLOW_WRITE_S}
    near: dict[str, Any] = {
        "backend": "file",
        "options": {"root": str(tmp_path / "near")},
        "layers": {"faults": {"ops": {"batch_set": slow, "batch_set_v1": slow}}},
    }
    with create_backend("chain", {"tiers": [near, far]}) as chain:
        chain.register_host_pool(pool)
        assert chain.batch_get_v1(["v"], indices + 64) == [True]
        assert chain.stats()["tiers"][0]["promoted"] == 0, "the read did not wait for the write"
        pool.kv_buffer.zero_()  # the pages are the caller's once the read returned
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert chain.stats()["tiers"][0]["promoted"] >= 1
    with create_backend("file", near["options"]) as local:
        local.register_host_pool(pool)
        assert local.batch_get_v1(["v"], indices + 128) == [True]
    with create_backend("file", far["options"]) as remote:
        remote.register_host_pool(pool)
        assert remote.batch_get_v1(["v"], indices + 192) == [True]
    views = pool.page_buffer_views(torch.arange(128, 256))
    assert [bytes(v) for v in views[0]] == [bytes(v) for v in views[1]], (
        "the page promoted is the page the later tier holds"
    )
