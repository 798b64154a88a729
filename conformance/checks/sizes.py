"""Value sizes and key shapes: large and odd-sized values, the empty value, the longest keys."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import (
    MiB,
    _bytes,
    _indices,
    _pool,
    _random_fill,
    mismatch,
    page_bytes,
    value_limit,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import BufferSizeError
from hicache_storage.keys.validation import MAX_KEY_LENGTH

__all__ = ["TestKeyShapes", "TestValueSizes"]

LARGEST = 64 * MiB
"""The largest value checked: the backend's ``max_value_size`` when that is smaller."""

# Odd sizes, so a tail lost after the last whole chunk (4 KiB, 64 KiB, 1 MiB) shows, and sizes
# of real KV pages (4-16 MiB and more); None is the largest the backend accepts, up to LARGEST.
VALUE_SIZES = [
    pytest.param(1, id="1B"),
    pytest.param(7, id="7B"),
    pytest.param(64 * 1024 + 1, id="64KiB+1"),
    pytest.param(3 * MiB + 4095, id="3MiB+4095"),
    pytest.param(4 * MiB + 1, id="4MiB+1"),
    pytest.param(16 * MiB + 3, id="16MiB+3"),
    pytest.param(None, id="largest"),
]

# Every character class of the key alphabet, with single dots only (``..`` is refused).
_FILLER = "Aa0_Zz9-b.C1"
_RANK = "_Qwen-Qwen2.5-7B_1_4"
"""A rank suffix as ``Deployment(...).rank_suffix()`` builds it (model, TP rank and size)."""


def _key_body(k: Keyspace, length: int, tail: str) -> str:
    """Return the name that ``k`` makes a key of exactly ``length`` characters ending in ``tail``.

    The body repeats :data:`_FILLER` (letters of both cases, digits, ``_``, ``-``, ``.``).
    """
    room = length - len(k.prefix) - len(tail)
    body = (_FILLER * (room // len(_FILLER) + 1))[:room]
    if body.endswith("."):
        body = body[:-1] + "x"
    return body + tail


class TestValueSizes:
    """Values of any size up to ``max_value_size``, odd and empty ones included, come back whole."""

    @pytest.mark.parametrize("size", VALUE_SIZES)
    def test_value_size_roundtrip_every_read_path(
        self,
        backend: StorageBackend,
        hicache_factory: BackendFactory,
        k: Keyspace,
        size: int | None,
    ) -> None:
        if size is None:
            size = value_limit(backend, hicache_factory.options, LARGEST)
        elif size > value_limit(backend, hicache_factory.options, size):
            pytest.skip(f"a {size}-byte value exceeds max_value_size or half the capacity")
        key = k("v")
        value = make_value(key, size)
        assert backend.set(key, value) is True, f"set of a {size}-byte value returned False"
        assert backend.exists(key) is True, f"exists is False after set of a {size}-byte value"
        got = backend.get(key)
        assert got is not None, f"get(k) of a {size}-byte value missed"
        problem = mismatch("get(k)", key, got, value)
        assert problem is None, problem
        del got
        out = bytearray(size)
        assert backend.get(key, out) is out, f"get(k, out) of a {size}-byte value missed"
        problem = mismatch("get(k, out)", key, out, value)
        assert problem is None, problem
        out = bytearray(size)
        assert backend.batch_get([key], [out]) == [True], f"batch_get of {size} bytes missed"
        problem = mismatch("batch_get", key, out, value)
        assert problem is None, problem

    def test_empty_value_is_a_hit(self, backend: StorageBackend, k: Keyspace) -> None:
        """``b""`` stored is a hit on every read path; refused (``False``), the key is absent."""
        key, absent = k("empty"), k("absent")
        if not backend.set(key, b""):
            assert backend.get(key) is None and not backend.exists(key), (
                "set(k, b'') returned False (not stored) but the key reads as present"
            )
            return
        got = backend.get(key)
        assert got is not None, "get(k) of an empty value returned None (a miss), expected b''"
        assert len(_bytes(got)) == 0, f"get(k) of an empty value returned {len(_bytes(got))} bytes"
        out = bytearray(0)
        assert backend.get(key, out) is out, "get(k, bytearray(0)) of an empty value missed"
        assert backend.exists(key) is True, "exists(k) is False for a key holding b''"
        assert backend.batch_exists([key, absent]) == 1, "batch_exists did not count the b'' key"
        got_batch = backend.batch_get([key, absent], [bytearray(0), bytearray(0)])
        assert got_batch == [True, False], (
            f"batch_get([empty, absent], [bytearray(0)] * 2) returned {got_batch}, "
            "expected [True, False]"
        )
        larger = bytearray(b"\x5a")
        with pytest.raises(BufferSizeError):
            backend.get(key, larger)
        assert larger == bytearray(b"\x5a"), "get(k, out) of an empty value changed a 1-byte out"
        assert backend.batch_get([key], [larger]) == [False], (
            "batch_get of an empty value into a 1-byte buffer must be a miss"
        )
        assert backend.batch_set([k("empty2")], [bytearray()]) == [True], (
            "batch_set of b'' returned False where set of b'' returned True"
        )
        assert backend.get(k("empty2"), bytearray(0)) is not None, "batch_set of b'' not stored"


class TestKeyShapes:
    """Keys up to ``MAX_KEY_LENGTH`` characters, of every allowed character, stay distinct."""

    @pytest.mark.parametrize("length", [65, 129, MAX_KEY_LENGTH])
    def test_long_keys_differing_at_the_end_stay_distinct(
        self, backend: StorageBackend, k: Keyspace, length: int
    ) -> None:
        # Rank-suffix style: one page hash, several ranks; plus a case-only difference.
        tails = ["_1_4", "_2_4", "_1_8", "_1_a", "_1_A"]
        keys = [k(_key_body(k, length, tail)) for tail in tails]
        sibling = k(_key_body(k, length, "_3_4"))
        for i, key in enumerate(keys):
            assert len(key) == length
            assert backend.set(key, make_value(key, 100 + i)) is True, (
                f"set of the {length}-character key {key!r} returned False"
            )
        for i, key in enumerate(keys):
            got = backend.get(key)
            assert got is not None, f"get of the {length}-character key {key!r} missed"
            problem = mismatch("get(k)", key, got, make_value(key, 100 + i))
            assert problem is None, (
                f"{problem}: keys of {length} characters that differ only in their last "
                "characters (or their case) share an object"
            )
        assert backend.exists(sibling) is False, (
            f"exists of the never-written key {sibling!r} is True: it shares an object with "
            f"a key that differs only in its last characters"
        )

    def test_longest_keys_every_operation(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = [k(_key_body(k, MAX_KEY_LENGTH, f"{_RANK}{i}")) for i in range(3)]
        values = [make_value(key, 4096 + i) for i, key in enumerate(keys)]
        assert all(len(key) == MAX_KEY_LENGTH for key in keys)
        ok = backend.set(keys[0], values[0])
        assert ok is True, (
            f"set of a {MAX_KEY_LENGTH}-character key returned False: a temporary or stored "
            "name built from the key may exceed NAME_MAX (255 bytes)"
        )
        assert backend.batch_set(keys[1:], values[1:]) == [True, True], (
            f"batch_set of {MAX_KEY_LENGTH}-character keys did not store them"
        )
        assert backend.batch_exists(keys) == 3, f"batch_exists of {MAX_KEY_LENGTH}-char keys"
        outs = [bytearray(len(v)) for v in values]
        assert backend.batch_get(keys, outs) == [True] * 3
        for key, out, value in zip(keys, outs, values, strict=True):
            problem = mismatch("batch_get", key, out, value)
            assert problem is None, problem
        pool = _pool("mha", "layer_first")
        _random_fill(pool, seed=17)
        backend.register_host_pool(pool)
        v1_keys = [k(_key_body(k, MAX_KEY_LENGTH, f"{_RANK}v{i}")) for i in range(2)]
        assert backend.batch_set_v1(v1_keys, _indices(pool, [1, 2])) == [True, True], (
            f"batch_set_v1 of {MAX_KEY_LENGTH}-character keys did not store them"
        )
        expected = page_bytes(pool, _indices(pool, [1, 2]))
        assert backend.batch_get_v1(v1_keys, _indices(pool, [5, 6])) == [True, True]
        for key, have, want in zip(
            v1_keys, page_bytes(pool, _indices(pool, [5, 6])), expected, strict=True
        ):
            problem = mismatch("batch_get_v1", key, have, want)
            assert problem is None, problem
