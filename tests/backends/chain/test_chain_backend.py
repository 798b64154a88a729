"""The chain backend: reads from the fastest tier holding a page, promotion, writes, faults."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import prometheus_client
import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.backends.chain.backend import chain_capabilities
from hicache_storage.backends.chain.behind import READ_ATTEMPTS
from hicache_storage.backends.chain.config import ChainConfig
from hicache_storage.backends.chain.promotion import HitCountPromotion
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import convert
from hicache_storage.errors import ConfigError, UnknownBackendError
from hicache_storage.hostpool import MHAHostPool

from ...helpers import assert_conforms, passing_suite, tmpfs

PAGE = 4
VALUE = 4096


def _file(root: Path, **options: Any) -> dict[str, Any]:
    return {"backend": "file", "options": {"root": str(root), **options}}


def _chain(*tiers: dict[str, Any], **options: Any) -> StorageBackend:
    return create_backend("chain", {"tiers": list(tiers), **options})


def _tier(chain: StorageBackend, index: int) -> dict[str, Any]:
    """Tier ``index``'s stats once the promotions and write-behind queued so far are stored."""
    assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
    entry: dict[str, Any] = chain.stats()["tiers"][index]
    return entry


def _calls(chain: StorageBackend, index: int) -> int:
    """How many calls tier ``index`` was asked, whatever they answered."""
    ops = _tier(chain, index)["stats"]["metrics"]["ops"]
    return sum(int(op["calls"]) for op in ops.values())


def _value(seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(VALUE))


@pytest.fixture
def near(tmp_path: Path) -> Path:
    return tmp_path / "near"


@pytest.fixture
def far(tmp_path: Path) -> Path:
    return tmp_path / "far"


@contextlib.contextmanager
def _file_backend(root: Path) -> Iterator[StorageBackend]:
    backend = create_backend("file", {"root": str(root)})
    try:
        yield backend
    finally:
        backend.close()


def test_a_page_only_the_later_tier_holds_is_served_promoted_then_served_near(
    near: Path, far: Path
) -> None:
    with _file_backend(far) as remote:
        assert remote.set("k", _value(1))
    with _chain(_file(near), _file(far)) as chain:
        assert bytes(chain.get("k") or b"") == _value(1)
        assert _tier(chain, 1)["hits"] == 1 and _tier(chain, 0)["promoted"] == 1
        out = bytearray(VALUE)
        assert chain.get("k", out) is out and bytes(out) == _value(1)
        assert _tier(chain, 0)["hits"] == 1 and _tier(chain, 1)["hits"] == 1
    with _file_backend(near) as local:
        assert local.get("k") == _value(1)


def test_two_tiers_of_one_backend_are_two_prometheus_series(near: Path, far: Path) -> None:

    def hits(tier: str) -> float:
        labels = {"backend": "file", "tier": tier, "op": "get", "outcome": "hit"}
        value = prometheus_client.REGISTRY.get_sample_value("hicache_storage_keys_total", labels)
        return value or 0.0

    with _file_backend(far) as remote:
        assert remote.set("series", _value(2))
    before = (hits("0"), hits("1"), hits(""))
    with _chain(_file(near), _file(far), promote_after_hits=0) as chain:
        assert bytes(chain.get("series") or b"") == _value(2)
        assert bytes(chain.get("series") or b"") == _value(2)
    assert (hits("0"), hits("1"), hits("")) == (before[0], before[1] + 2, before[2])


def test_each_tier_reports_how_full_it_is_while_open(near: Path, far: Path) -> None:

    def gauge(tier: str, measure: str) -> float | None:
        labels = {"backend": "file", "tier": tier, "measure": measure}
        value: float | None = prometheus_client.REGISTRY.get_sample_value(
            "hicache_storage_capacity_bytes", labels
        )
        return value

    near_bound, far_bound = 3 * 2**20, 5 * 2**20
    tiers = (_file(near, max_bytes=near_bound), _file(far, max_bytes=far_bound))
    with _chain(*tiers) as chain:
        assert chain.set("full", _value(3))
        for index, bound in enumerate((near_bound, far_bound)):
            capacity = _tier(chain, index)["stats"]["capacity"]
            assert capacity["bound_bytes"] == bound and capacity["used_bytes"] >= VALUE
            assert capacity["scope"] == "namespace" and capacity["evictions"] == 0
            assert gauge(str(index), "bound") == bound
            assert (gauge(str(index), "used") or 0) >= VALUE
    assert gauge("0", "bound") != near_bound and gauge("1", "bound") != far_bound


def test_promotion_waits_for_the_hits_it_is_told_and_zero_never_promotes(
    near: Path, far: Path
) -> None:
    with _file_backend(far) as remote:
        assert remote.batch_set(["a", "b"], [_value(2), _value(3)]) == [True, True]
    with _chain(_file(near), _file(far), promote_after_hits=2) as chain:
        assert chain.get("a") is not None and _tier(chain, 0)["promoted"] == 0
        assert chain.get("a") is not None and _tier(chain, 0)["promoted"] == 1
        assert chain.get("a") is not None and _tier(chain, 0)["hits"] == 1
    with _chain(_file(near / "other"), _file(far), promote_after_hits=0) as chain:
        for _ in range(3):
            assert chain.batch_get(["b"], [bytearray(VALUE)]) == [True]
        assert _tier(chain, 0)["promoted"] == 0 and _tier(chain, 1)["hits"] == 3


def test_hit_counting_forgets_the_oldest_keys_beyond_its_table() -> None:
    policy = HitCountPromotion(2, counted_keys=2)
    assert policy.admit(["a", "b", "c"]) == [False, False, False]  # "a" forgotten
    assert policy.admit(["a", "c"]) == [False, True]


def test_batch_exists_counts_the_run_held_by_the_tiers_together(near: Path, far: Path) -> None:
    with _file_backend(near) as local, _file_backend(far) as remote:
        assert local.batch_set(["k0", "k1", "k4"], [_value(i) for i in range(3)]) == [True] * 3
        assert remote.batch_set(["k2", "k3", "k6"], [_value(i) for i in range(3)]) == [True] * 3
    with _chain(_file(near), _file(far)) as chain:
        assert chain.batch_exists([f"k{i}" for i in range(7)]) == 5
        assert chain.batch_exists(["k2", "k0"]) == 2
        assert chain.batch_exists(["k5", "k0"]) == 0
        assert chain.exists("k6") and not chain.exists("k5")


@pytest.mark.parametrize("policy", ["through", "behind"])
def test_a_later_write_never_places_what_the_later_tier_does_not_keep(
    near: Path, far: Path, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write withheld from the first tier, a second of another value chosen for it:
    the first tier takes nothing the later tier does not keep, so every read agrees."""
    with _chain(_file(near), _file(far), write_policy=policy) as chain:
        script = iter([False, True])  # the writes of "k"; nothing else is placed

        def choose(keys: list[str]) -> list[bool]:
            return [key == "k" and next(script, False) for key in keys]

        pays = chain.unwrap()._measures["objects"].pays  # type: ignore[attr-defined]
        monkeypatch.setattr(pays, "choose", choose)
        assert chain.set("k", _value(1)) and chain.set("k", _value(2))
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert chain.get("k") == _value(1)
    with _file_backend(near) as local, _file_backend(far) as remote:
        assert not local.exists("k") and remote.get("k") == _value(1)


@pytest.mark.parametrize("policy", ["through", "behind"])
def test_a_later_tier_that_missed_a_key_gets_the_first_tiers_value(
    near: Path, far: Path, policy: str
) -> None:
    """A later tier that missed a key's first write (failing then, or evicted since) is given
    the first tier's value when the key is written again, never the new one: the tiers never
    hold two values, and writes reach a remote store that comes back."""
    with _file_backend(near) as local:
        assert local.set("k", _value(1))
    with _chain(_file(near), _file(far), write_policy=policy) as chain:
        assert chain.set("k", _value(2))
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert chain.get("k") == _value(1)
        writes = chain.stats()["writes"]["objects"]
        assert writes == {"held": 1, "filled": 1 if policy == "through" else 0}
    with _file_backend(far) as remote:
        assert remote.get("k") == _value(1)


@pytest.mark.parametrize("policy", ["through", "behind"])
def test_a_later_tier_that_missed_a_page_gets_the_first_tiers_page(
    near: Path, far: Path, policy: str
) -> None:
    """The same through the zero-copy calls: the page a later tier is given is the one the
    first tier holds, read out of it, never the host pool's newer bytes under that key."""
    first, second = _pool(), _pool()
    _fill(first, 3)
    _fill(second, 4)
    with _file_backend(near) as local:
        local.register_host_pool(first)
        assert local.batch_set_v1(["p"], torch.arange(PAGE)) == [True]
    with _chain(_file(near), _file(far), write_policy=policy) as chain:
        chain.register_host_pool(second)
        assert chain.batch_set_v1(["p"], torch.arange(PAGE)) == [True]
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert chain.stats()["writes"]["pages"]["held"] == 1
    read = _pool()
    with _file_backend(far) as remote:
        remote.register_host_pool(read)
        assert remote.batch_get_v1(["p"], torch.arange(PAGE)) == [True]
    assert _pages(read, 1) == _pages(first, 1) != _pages(second, 1)


def test_batch_exists_asks_no_tier_again_where_its_run_ended(near: Path, far: Path) -> None:
    with _file_backend(far) as remote:
        assert remote.batch_set(["k0", "k1"], [_value(i) for i in range(2)]) == [True] * 2
    with _chain(_file(near), _file(far)) as chain:
        assert chain.batch_exists([f"k{i}" for i in range(4)]) == 2
        # near from k0 (nothing), far from k0 (two), near from k2 (nothing): far said it
        # lacks k2, so no fourth call
        assert (_calls(chain, 0), _calls(chain, 1)) == (2, 1)


def _pool() -> MHAHostPool:
    return MHAHostPool(8 * PAGE, PAGE, 2, 2, 8, torch.float16, "page_first", False)


def _fill(pool: MHAHostPool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))


def _pages(pool: MHAHostPool, count: int) -> list[bytes]:
    views = pool.page_buffer_views(torch.arange(count * PAGE))
    return [b"".join(bytes(view) for view in page) for page in views]


def test_v1_pages_come_from_their_holders_and_promoted_pages_are_the_written_ones(
    near: Path, far: Path
) -> None:
    written = _pool()
    _fill(written, 7)
    keys = [f"p{i}" for i in range(4)]
    indices = torch.arange(4 * PAGE)
    with _file_backend(near) as local, _file_backend(far) as remote:
        local.register_host_pool(written)
        remote.register_host_pool(written)
        assert local.batch_set_v1(keys[:1], indices[:PAGE]) == [True]
        assert remote.batch_set_v1(keys[1:], indices[PAGE:]) == [True] * 3
    read = _pool()
    with _chain(_file(near), _file(far)) as chain:
        chain.register_host_pool(read)
        assert chain.batch_get_v1(keys, indices) == [True] * 4
        assert _pages(read, 4) == _pages(written, 4)
        # Objects served: each page and its integrity record (the chain's verify layer reads it).
        assert [_tier(chain, i)["hits"] for i in (0, 1)] == [2, 6]
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert _tier(chain, 0)["promoted"] == 6
        again = _pool()
        chain.register_host_pool(again)
        assert chain.batch_get_v1(keys, indices.tolist()) == [True] * 4
        assert _pages(again, 4) == _pages(written, 4)
        assert [_tier(chain, i)["hits"] for i in (0, 1)] == [10, 6]


def test_a_corrupt_page_of_a_later_tier_is_a_miss_never_bytes(near: Path, far: Path) -> None:
    written = _pool()
    _fill(written, 11)
    with _chain(_file(near), _file(far)) as chain:
        chain.register_host_pool(written)
        assert chain.batch_set_v1(["p"], torch.arange(PAGE)) == [True]
    (page,) = far.rglob("p")  # the file backend names a page's file by its key
    data = bytearray(page.read_bytes())
    data[len(data) // 2] ^= 0xFF
    page.write_bytes(data)
    with _file_backend(near) as local:
        local.clear()
    read = _pool()
    with _chain(_file(near), _file(far)) as chain:
        chain.register_host_pool(read)
        assert chain.batch_get_v1(["p"], torch.arange(PAGE)) == [False]


def test_write_through_stores_every_tier(near: Path, far: Path) -> None:
    with _chain(_file(near), _file(far)) as chain:
        assert chain.batch_set(["a", "b"], [_value(4), _value(5)]) == [True, True]
        assert chain.set("c", _value(6))
    for root in (near, far):
        with _file_backend(root) as tier:
            assert tier.batch_exists(["a", "b", "c"]) == 3


def test_write_behind_returns_once_the_first_tier_holds_and_copies_later(
    near: Path, far: Path
) -> None:
    slow = {"faults": {"ops": {"batch_set": {"delay_s": 0.3}}}}
    far_tier = {**_file(far), "layers": slow}
    with _chain(_file(near), far_tier, write_policy="behind") as chain:
        keys = [f"w{i}" for i in range(5)]
        assert chain.batch_set(keys, [_value(i) for i in range(5)]) == [True] * 5
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        behind = chain.stats()["write_behind"]
        assert behind["written"] == 5 and behind["pending"] == 0 and behind["shed"] == 0
    with _file_backend(far) as remote:
        assert remote.batch_exists(keys) == 5


def test_write_behind_sheds_beyond_its_queue_and_drains_on_close(near: Path, far: Path) -> None:
    slow = {"faults": {"ops": {"batch_set": {"delay_s": 0.5}}}}
    far_tier = {**_file(far), "layers": slow}
    chain = _chain(_file(near), far_tier, write_policy="behind", max_pending_pages=2)
    for i in range(6):
        assert chain.set(f"s{i}", _value(i))
    shed = chain.stats()["write_behind"]["shed"]
    assert shed >= 1
    chain.close()
    with _file_backend(far) as remote:
        assert sum(remote.exists(f"s{i}") for i in range(6)) == 6 - shed


def test_a_deleted_page_never_reaches_a_later_tier_afterwards(near: Path, far: Path) -> None:
    slow = {"faults": {"ops": {"batch_set": {"delay_s": 0.3}}}}
    far_tier = {**_file(far), "layers": slow}
    with _chain(_file(near), far_tier, write_policy="behind") as chain:
        for i in range(4):
            assert chain.set(f"d{i}", _value(i))
        assert chain.delete("d3")
        chain.clear()
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        assert not any(chain.exists(f"d{i}") for i in range(4))
    with _file_backend(far) as remote:
        assert not any(remote.exists(f"d{i}") for i in range(4))


def test_write_behind_reads_again_what_the_first_tier_holds_but_failed_to_read(
    near: Path, far: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-back that misses (a failed read: the tier's layers answer it as a miss) of a page
    the first tier still holds is tried again; a page the first tier no longer holds is
    missing; a page never read back is failed after READ_ATTEMPTS reads."""
    with _chain(_file(near), _file(far), write_policy="behind") as chain:
        first = chain.unwrap().tiers[0]  # type: ignore[attr-defined]
        read = first.batch_get
        calls = []

        def flaky(keys: list[str], outs: list[bytearray]) -> list[bool]:
            calls.append(list(keys))
            if len(calls) == 1:
                assert first.delete("gone")  # evicted before its turn
                return [False] * len(keys)
            hits = read(keys, outs)
            return [hit and key != "stuck" for key, hit in zip(keys, hits, strict=True)]

        monkeypatch.setattr(first, "batch_get", flaky)
        assert chain.batch_set(["a", "gone", "stuck"], [_value(i) for i in range(3)]) == [True] * 3
        assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        behind = chain.stats()["write_behind"]
        counts = {name: behind[name] for name in ("written", "missing", "failed", "retried")}
        assert counts == {"written": 1, "missing": 1, "failed": 1, "retried": READ_ATTEMPTS}
        assert sum(key == "stuck" for batch in calls for key in batch) == READ_ATTEMPTS
    with _file_backend(far) as remote:
        assert [remote.exists(key) for key in ("a", "gone", "stuck")] == [True, False, False]


def test_a_page_too_big_for_the_first_tier_is_refused_and_backs_off_no_promotion(
    near: Path, far: Path
) -> None:
    with _file_backend(far) as remote:
        assert remote.set("huge", bytes(8 * VALUE))
        assert remote.batch_set([f"h{i}" for i in range(3)], [_value(i) for i in range(3)])
    small = _file(near, max_bytes=4 * VALUE, min_free_bytes=0)
    with _chain(small, _file(far)) as chain:
        for _ in range(2):
            assert chain.get("huge") == bytes(8 * VALUE)
        for i in range(3):
            assert chain.get(f"h{i}") == _value(i)
        tier = _tier(chain, 0)
        assert tier["promoted"] == 3 and tier["promotion_refused"] == 2
        assert tier["promotion_failed"] == 0 and tier["promotion_shed"] == 0
    with _file_backend(near) as local:
        assert local.batch_exists([f"h{i}" for i in range(3)]) == 3 and not local.exists("huge")


def test_a_failing_later_tier_costs_no_local_hit(near: Path, far: Path) -> None:
    broken = {"faults": {"default": {"failure_rate": 1.0}}}
    with _file_backend(near) as local:
        assert local.set("held", _value(8))
    with _chain(_file(near), {**_file(far), "layers": broken}) as chain:
        before = _calls(chain, 1)
        assert chain.get("held") is not None and chain.batch_exists(["held"]) == 1
        assert _calls(chain, 1) == before  # a page held near never asks the far tier
        assert chain.set("new", _value(9))  # stored near although the far tier fails
        assert chain.get("missing") is None
        far_stats = _tier(chain, 1)["stats"]
        assert far_stats["metrics"]["ops"]["batch_set"]["fail"] == 1  # the write it failed
        assert far_stats["degraded"]["errors"]["get"] == {"InjectedFaultError": 1}


def test_a_slow_later_tier_is_not_asked_for_pages_held_near(near: Path, far: Path) -> None:
    slow = {"faults": {"default": {"delay_s": 0.2}}}
    with _chain(_file(near), {**_file(far), "layers": slow}, write_policy="behind") as chain:
        assert chain.set("a", _value(1))
        before = _calls(chain, 1)
        for _ in range(5):
            assert chain.batch_get(["a"], [bytearray(VALUE)]) == [True]
            assert chain.batch_exists(["a"]) == 1
        assert _calls(chain, 1) == before


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: writes past it fail with ENOSPC, remounted read-only with EROFS."""
    with tmpfs(tmp_path / "small") as mount:
        yield mount


def test_a_full_local_disk_never_loses_a_write(small_disk: Path, far: Path) -> None:
    big = 256 * 1024
    values = [bytes([i]) * big for i in range(8)]  # 2 MiB into a 1 MiB disk
    keys = [f"f{i}" for i in range(8)]
    with _chain(_file(small_disk / "root"), _file(far)) as chain:
        assert chain.batch_set(keys, values) == [True] * 8
        for key, value in zip(keys, values, strict=True):
            out = bytearray(big)
            assert chain.get(key, out) is out and bytes(out) == value
    with _file_backend(far) as remote:
        assert remote.batch_exists(keys) == 8


def test_a_read_only_local_root_serves_from_the_remote_and_sheds_promotions(
    small_disk: Path, far: Path
) -> None:
    with _file_backend(small_disk / "root") as local:
        assert local.set("near", _value(1))
    with _file_backend(far) as remote:
        assert remote.batch_set([f"r{i}" for i in range(3)], [_value(i) for i in range(3)])
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with _chain(_file(small_disk / "root"), _file(far)) as chain:
        assert chain.get("near") == _value(1)
        for i in range(3):
            assert chain.get(f"r{i}") == _value(i)
            assert chain.unwrap().flush(30.0)  # type: ignore[attr-defined]
        tier = _tier(chain, 0)
        assert tier["promoted"] == 0 and tier["promotion_failed"] == 1
        assert tier["promotion_shed"] == 2  # asked again only after the back-off
        assert chain.set("w", _value(5))  # the remote holds the write
    with _file_backend(far) as remote:
        assert remote.exists("w")


def test_the_chain_claims_what_its_tiers_together_keep() -> None:
    strong = Capabilities(
        persistent=True, shared=True, delete=True, crash_safe_writes=True, atomic_first_wins=True
    )
    weak = Capabilities(delete=True, atomic_first_wins=True, max_value_size=100)
    both = chain_capabilities([weak, strong])
    assert both.persistent and not both.shared and both.delete
    assert not both.crash_safe_writes and not both.atomic_first_wins
    assert both.max_value_size == 100
    assert chain_capabilities([strong]).atomic_first_wins


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tiers": []}, "at least one tier"),
        ({"tiers": [{"backend": "chain"}]}, "cannot be another chain"),
        ({"tiers": [{"backend": "memory"}], "promote_after_hits": -1}, "promote_after_hits"),
        ({"tiers": [{"backend": "memory", "option": 1}]}, "option"),
    ],
)
def test_bad_chain_options_are_refused_with_their_reason(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        create_backend("chain", options)


def test_a_tier_that_is_not_registered_is_named(tmp_path: Path) -> None:
    with pytest.raises(UnknownBackendError, match="nosuch"):
        create_backend("chain", {"tiers": [_file(tmp_path), {"backend": "nosuch"}]})


def test_config_secrets_of_a_tier_never_show() -> None:
    config = convert(
        {"tiers": [{"backend": "redis", "options": {"url": "redis://:hunter2@h:1/0"}}]},
        ChainConfig,
        "chain",
    )
    assert "hunter2" not in repr(config)
    assert msgspec.to_builtins(config)["tiers"][0]["backend"] == "redis"


@pytest.mark.timeout(900)
def test_memory_before_file_passes_the_suite(tmp_path: Path) -> None:
    config = {"tiers": [{"backend": "memory"}, _file(tmp_path / "store")]}
    report = passing_suite("chain", config, tmp_path / "report")
    assert report.backend == "chain"
    assert {"persistent", "delete"} <= set(report.capabilities)
    assert "shared" not in report.capabilities
    assert_conforms(report)
