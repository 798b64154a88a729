"""Batch calls: one answer per key, in order; ``batch_exists`` counts the leading hits."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import SENTINEL, slot_problem
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import BatchMismatchError

__all__ = ["TestBatch", "TestPrefix"]


class TestBatch:
    """Batch calls: one answer per key, in order, for every batch shape."""

    def test_batch_get_preserves_order(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("o", 6)
        values = [make_value(key, 100 + 37 * i) for i, key in enumerate(keys)]
        assert backend.batch_set(keys, values) == [True] * 6
        order = [4, 0, 5, 2, 1, 3]
        outs = [bytearray(len(values[i])) for i in order]
        assert backend.batch_get([keys[i] for i in order], outs) == [True] * 6
        for i, out in zip(order, outs, strict=True):
            assert bytes(out) == values[i]

    def test_batch_results_length_matches_keys(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("l", 5)
        set_result = backend.batch_set(keys, [b"abc"] * 5)
        get_result = backend.batch_get(keys, [bytearray(3) for _ in keys])
        assert len(set_result) == 5 and len(get_result) == 5

    def test_batch_empty_returns_empty(self, backend: StorageBackend) -> None:
        assert backend.batch_set([], []) == []
        assert backend.batch_get([], []) == []
        assert backend.batch_exists([]) == 0

    def test_batch_duplicate_keys_consistent(self, backend: StorageBackend, k: Keyspace) -> None:
        one, two = make_value("dup1", 64), make_value("dup2", 64)
        assert backend.batch_set([k("d"), k("d")], [one, two]) == [True, True]
        outs = [bytearray(64), bytearray(64)]
        assert backend.batch_get([k("d"), k("d")], outs) == [True, True]
        assert bytes(outs[0]) in (one, two) and outs[0] == outs[1]
        assert backend.batch_exists([k("d"), k("d")]) == 2

    def test_batch_long_300_keys(self, backend: StorageBackend, k: Keyspace) -> None:
        # A bounded store that holds fewer objects keeps a batch up to its declared bound.
        bound = backend.stats().get("max_objects")
        n = min(300, bound) if isinstance(bound, int) and not isinstance(bound, bool) else 300
        keys = k.many("long", n)
        values = [make_value(key, 64 + i % 7) for i, key in enumerate(keys)]
        assert backend.batch_set(keys, values) == [True] * n
        assert backend.batch_exists(keys) == n
        outs = [bytearray(len(v)) for v in values]
        assert backend.batch_get(keys, outs) == [True] * n
        assert all(bytes(o) == v for o, v in zip(outs, values, strict=True))

    @pytest.mark.parametrize("shape", ["HMHMHM", "MHHMMH"], ids=["alternating", "miss-first"])
    def test_batch_get_per_key_hit_miss(
        self, backend: StorageBackend, k: Keyspace, shape: str
    ) -> None:
        """Each key is answered for itself, and every buffer is compared, not the leading run.

        ``shape`` says which keys are stored (``H``) and which are not (``M``): hits after a
        miss, runs of misses, a batch that starts with one. A hit's buffer holds its value; a
        miss's buffer, before or after the first miss, keeps its sentinel bytes.
        """
        keys = k.many(f"hm-{shape}-", len(shape))
        values = [make_value(key, 128 + i) for i, key in enumerate(keys)]
        for key, value, kind in zip(keys, values, shape, strict=True):
            if kind == "H":
                assert backend.set(key, value), f"set({key!r}) failed"
        outs = [bytearray([SENTINEL]) * len(value) for value in values]
        got = backend.batch_get(keys, outs)
        expected = [kind == "H" for kind in shape]
        assert got == expected, (
            f"batch_get of keys stored as {shape} (H stored, M not) returned {got}, expected "
            f"{expected}: one answer per key, after a miss too"
        )
        problems = [
            f"key {i} ({'stored' if kind == 'H' else 'a miss'}): {text}"
            for i, (out, value, kind) in enumerate(zip(outs, values, shape, strict=True))
            if (text := slot_problem(out, value if kind == "H" else None)) is not None
        ]
        assert not problems, (
            f"batch_get of keys stored as {shape} left {len(problems)} wrong buffer(s): "
            + "; ".join(problems)
        )

    @pytest.mark.parametrize("delta", [-1, 1], ids=["smaller", "larger"])
    def test_batch_get_wrong_size_is_miss(
        self, backend: StorageBackend, k: Keyspace, delta: int
    ) -> None:
        assert backend.set(k("a"), b"x" * 100) and backend.set(k("b"), b"y" * 10)
        outs = [bytearray(b"\x5a" * (100 + delta)), bytearray(10)]
        got = backend.batch_get([k("a"), k("b")], outs)
        assert got == [False, True], (
            f"batch_get of a 100-byte object into a {100 + delta}-byte buffer (and of a 10-byte "
            f"one into a 10-byte buffer) returned {got}, expected [False, True]"
        )
        assert outs[0] == bytearray(b"\x5a" * (100 + delta)), (
            f"batch_get of a 100-byte object wrote into the {100 + delta}-byte buffer it refused"
        )
        assert bytes(outs[1]) == b"y" * 10

    def test_batch_mismatched_lengths_refused(self, backend: StorageBackend, k: Keyspace) -> None:
        with pytest.raises(BatchMismatchError):
            backend.batch_set([k("a"), k("b")], [b"x"])
        with pytest.raises(BatchMismatchError):
            backend.batch_get([k("a")], [bytearray(1), bytearray(1)])
        assert backend.exists(k("a")) is False


class TestPrefix:
    """``batch_exists`` counts the leading run of hits and stops at the first gap."""

    def test_batch_exists_first_missing_zero(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("p", 4)
        for key in keys[1:]:
            assert backend.set(key, b"v")
        assert backend.batch_exists(keys) == 0

    def test_batch_exists_all_hit_n(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("p", 7)
        assert backend.batch_set(keys, [b"v"] * 7) == [True] * 7
        assert backend.batch_exists(keys) == 7

    def test_batch_exists_stops_at_gap(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("p", 6)
        for i, key in enumerate(keys):
            if i != 2:
                assert backend.set(key, b"v")
        assert backend.batch_exists(keys) == 2
        assert backend.batch_exists(keys[3:]) == 3
