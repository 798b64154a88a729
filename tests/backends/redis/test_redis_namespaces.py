"""Namespaces: key ``k`` under prefix ``p`` is ``p:k``, and no prefix sees or clears another's.

Keys never hold ``:``, so ``<prefix>:<key>`` names one (prefix, key) pair: ``t`` + ``xabc`` and
``tx`` + ``abc`` are different objects, and ``clear()`` of ``tenant`` leaves ``tenant2`` and the
nested ``tenant:sub`` alone. Standalone and cluster.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicache_storage import StorageBackend, create_backend
from hicache_storage.backends.redis import RedisConfig
from hicache_storage.errors import ConfigError
from hicache_storage.kit.services import LocalService

from .test_redis_backend import raw_client


@pytest.mark.parametrize(
    "prefix", ["", ":", "a b", "t*", "{tag}", "a::b", ":a", "a:", "ns:/", "é", "a\nb"]
)
def test_prefix_outside_the_namespace_rule_is_refused(prefix: str) -> None:
    if prefix == "a:":
        assert RedisConfig(url="redis://h", prefix=prefix).namespace == "a"
        return
    with pytest.raises(ConfigError, match="prefix"):
        create_backend("redis", {"url": "redis://h", "prefix": prefix})


def test_trailing_colon_names_the_same_objects(
    make: Callable[[str], StorageBackend], redis_service: LocalService
) -> None:
    with_colon, without = make(prefix="ns-colon:"), make(prefix="ns-colon")
    assert with_colon.set("page", b"value")
    assert without.get("page") == b"value"
    assert without.stats()["prefix"] == with_colon.stats()["prefix"] == "ns-colon"
    raw = raw_client(redis_service)
    try:
        assert raw.get(b"ns-colon:page") == b"value"
    finally:
        raw.close()


@pytest.mark.parametrize(
    ("short", "long"),
    [("t", "tx"), ("tenant", "tenant2"), ("tenant", "tenant:sub"), ("tenant:", "tenant2:")],
)
def test_prefixes_extending_each_other_never_share_or_clear(
    make: Callable[[str], StorageBackend],
    redis_service: LocalService,
    short: str,
    long: str,
) -> None:
    a, b = make(prefix=short), make(prefix=long)
    # Under the old rule (name = prefix + key) these two were one object.
    tail = long.rstrip(":")[len(short.rstrip(":")) :].lstrip(":")
    assert a.set(f"{tail}abc", b"from a") and b.set("abc", b"from b")
    assert a.get(f"{tail}abc") == b"from a" and b.get("abc") == b"from b"
    keys = [f"page-{i}" for i in range(40)]
    assert a.batch_set(keys, [b"a"] * 40) == [True] * 40
    assert b.batch_set(keys, [b"b"] * 40) == [True] * 40
    out = bytearray(1)
    assert b.batch_get(keys[:1], [out]) == [True] and out == b"b"
    raw = raw_client(redis_service)
    try:
        raw.set(f"{short.rstrip(':')}{tail}-unrelated".encode(), b"keep me")
        a.clear()
        assert a.batch_exists(keys) == 0 and a.get(f"{tail}abc") is None
        assert b.batch_exists(keys) == 40 and b.get("abc") == b"from b"
        assert raw.get(f"{short.rstrip(':')}{tail}-unrelated".encode()) == b"keep me"
        assert a.batch_set(keys, [b"a"] * 40) == [True] * 40
        b.clear()
        assert b.batch_exists(keys) == 0 and a.batch_exists(keys) == 40
    finally:
        raw.delete(f"{short.rstrip(':')}{tail}-unrelated".encode())
        raw.close()


def test_clear_leaves_nested_namespaces(
    make: Callable[[str], StorageBackend], redis_service: LocalService
) -> None:
    outer, inner, deeper = make(prefix="org"), make(prefix="org:team"), make(prefix="org:team:job")
    for backend in (outer, inner, deeper):
        assert backend.batch_set(["k1", "k2"], [b"x", b"y"]) == [True, True]
    inner.clear()
    assert outer.batch_exists(["k1", "k2"]) == 2 and deeper.batch_exists(["k1", "k2"]) == 2
    assert inner.batch_exists(["k1", "k2"]) == 0
    outer.clear()
    assert deeper.batch_exists(["k1", "k2"]) == 2
