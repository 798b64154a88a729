"""Namespaces that prefix each other stay disjoint on the real gateway: reads, writes and clear.

A prefix always ends in ``/``, which no key contains (``tok`` is completed to ``tok/``), so
``tok`` + ``xk`` and ``tokx`` + ``k`` are different objects, and ``clear()`` deletes only direct
children of its own prefix: never a sibling's (``tokx/``) nor a nested one's (``tok/sub/``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hicache_storage import StorageBackend

from .test_s3_backend import object_names

PAIRS = [("tok", "tokx"), ("tok/", "tokx/"), ("tok/", "tok/sub/"), ("tok", "tok/sub")]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_prefixes_never_see_each_others_keys(
    s3_options: dict[str, Any], make_s3: Callable[..., StorageBackend], first: str, second: str
) -> None:
    base = s3_options["prefix"]
    a, b = make_s3(prefix=base + first), make_s3(prefix=base + second)
    # With plain concatenation "tok" + "xk1" and "tokx" + "k1" would be one object.
    assert a.set("xk1", b"a:xk1") and a.set("k1", b"a:k1")
    assert not b.exists("k1") and b.get("k1") is None and b.batch_exists(["k1"]) == 0
    assert b.get("xk1") is None
    assert b.set("k1", b"b:k1")
    assert a.get("k1") == b"a:k1" and a.get("xk1") == b"a:xk1" and b.get("k1") == b"b:k1"
    names = object_names(s3_options, base)
    assert f"{base}{first.rstrip('/')}/xk1" in names
    assert f"{base}{second.rstrip('/')}/k1" in names


@pytest.mark.parametrize(("first", "second"), PAIRS)
@pytest.mark.parametrize("cleared", ["first", "second"])
def test_clear_removes_only_its_own_prefix(
    s3_options: dict[str, Any],
    make_s3: Callable[..., StorageBackend],
    first: str,
    second: str,
    cleared: str,
) -> None:
    base = s3_options["prefix"]
    a, b = make_s3(prefix=base + first), make_s3(prefix=base + second)
    keys = ["k1", "k2", "xk1"]
    assert a.batch_set(keys, [b"a"] * 3) == [True] * 3
    assert b.batch_set(keys, [b"b"] * 3) == [True] * 3
    wiper, other, kept = (a, b, b"b") if cleared == "first" else (b, a, b"a")
    wiper.clear()
    assert wiper.batch_exists(keys) == 0 and wiper.get("xk1") is None
    outs = [bytearray(1) for _ in keys]
    assert other.batch_get(keys, outs) == [True] * 3, f"clear() of {cleared} removed the other's"
    assert all(bytes(out) == kept for out in outs)
    other.clear()
    assert object_names(s3_options, base) == set()


def test_prefix_with_and_without_slash_is_one_namespace(
    make_s3: Callable[..., StorageBackend], s3_options: dict[str, Any]
) -> None:
    base = s3_options["prefix"]
    plain, slashed = make_s3(prefix=base + "same"), make_s3(prefix=base + "same/")
    assert plain.set("k1", b"one")
    assert slashed.get("k1") == b"one"
    assert object_names(s3_options, base) == {f"{base}same/k1"}
    slashed.clear()
    assert plain.exists("k1") is False
