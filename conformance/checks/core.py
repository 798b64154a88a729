"""The core contract: round trips byte for byte, misses as values, idempotent writes."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import as_writable
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    KiB,
    MiB,
    _bytes,
    _indices,
    _pool,
    _random_fill,
    _sentinel_fill,
    mismatch,
    page_bytes,
    slot_problem,
)
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.conformance.workers import digest, make_value

__all__ = ["TestRoundTrip", "TestMiss", "TestIdempotentSet"]


def _value_inputs() -> dict[str, Callable[[bytes], object]]:
    return {
        "bytes": lambda raw: raw,
        "bytearray": lambda raw: bytearray(raw),
        "memoryview": lambda raw: memoryview(raw),
        "numpy_uint8": lambda raw: np.frombuffer(raw, dtype=np.uint8).copy(),
        "numpy_float32_2d": lambda raw: np.frombuffer(raw, dtype=np.float32).reshape(4, -1).copy(),
        "torch_uint8": lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        "torch_float16_2d": lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.float16).view(
            8, -1
        ),
    }


def _out_buffers() -> dict[str, Callable[[int], object]]:
    return {
        "bytearray": lambda n: bytearray(n),
        "memoryview": lambda n: memoryview(bytearray(n)),
        "numpy": lambda n: np.zeros(n, dtype=np.uint8),
        "torch": lambda n: torch.zeros(n, dtype=torch.uint8),
    }


ROUND_TRIP_SIZES = [1, 2, 255, 4 * KiB, 64 * KiB + 3, 1 * MiB, 4 * MiB]


class TestRoundTrip:
    """What is stored is what is read back, byte for byte, for every accepted input."""

    @pytest.mark.parametrize("size", ROUND_TRIP_SIZES, ids=lambda s: f"{s}B")
    def test_roundtrip_get_matches_sha256(
        self, backend: StorageBackend, k: Keyspace, size: int
    ) -> None:
        value = make_value(k("v"), size)
        assert backend.set(k("v"), value) is True
        got = backend.get(k("v"))
        assert got is not None
        assert digest(got) == digest(value)

    @pytest.mark.parametrize("size", ROUND_TRIP_SIZES, ids=lambda s: f"{s}B")
    def test_roundtrip_get_into_out_matches_sha256(
        self, backend: StorageBackend, k: Keyspace, size: int
    ) -> None:
        value = make_value(k("v"), size)
        assert backend.set(k("v"), value)
        out = bytearray(size)
        assert backend.get(k("v"), out) is out
        assert digest(out) == digest(value)

    @pytest.mark.parametrize("kind", list(_value_inputs()))
    def test_roundtrip_input_type_accepted(
        self, backend: StorageBackend, k: Keyspace, kind: str
    ) -> None:
        raw = make_value(k("v"), 4 * KiB)
        assert backend.set(k("v"), _value_inputs()[kind](raw))  # type: ignore[arg-type]
        got = backend.get(k("v"))
        assert got is not None and _bytes(got) == raw

    @pytest.mark.parametrize("kind", list(_out_buffers()))
    def test_roundtrip_out_type_filled(
        self, backend: StorageBackend, k: Keyspace, kind: str
    ) -> None:
        raw = make_value(k("v"), 4 * KiB)
        assert backend.set(k("v"), raw)
        out = _out_buffers()[kind](len(raw))
        assert backend.get(k("v"), out) is out  # type: ignore[arg-type]
        assert _bytes(out) == raw

    def test_set_copies_value_before_returning(self, backend: StorageBackend, k: Keyspace) -> None:
        # The caller reuses its buffers (a host page is refilled for the next request).
        raw = make_value(k("v"), 64 * KiB + 5)
        sources: dict[str, bytearray | np.ndarray | torch.Tensor] = {
            "bytearray": bytearray(raw),
            "numpy": np.frombuffer(raw, dtype=np.uint8).copy(),
            "torch": torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        }
        for kind, source in sources.items():
            assert backend.set(k(kind), source) is True  # type: ignore[arg-type]
            np.frombuffer(as_writable(source), dtype=np.uint8)[:] = 0
        batch = bytearray(raw)
        assert backend.batch_set([k("batch")], [batch]) == [True]
        batch[:] = b"\xff" * len(raw)
        for kind in [*sources, "batch"]:
            got = backend.get(k(kind))
            assert got is not None, f"get of {k(kind)!r} missed after set from a {kind}"
            problem = mismatch("get", k(kind), got, raw)
            assert problem is None, (
                f"{problem}: the caller changed its {kind} buffer after set returned, and the "
                "stored value changed with it (set must copy the value before it returns)"
            )
        pool = _pool("mla", "page_first")  # one buffer per page: the value is the pool's memory
        _random_fill(pool, seed=41)
        backend.register_host_pool(pool)
        want = page_bytes(pool, _indices(pool, [2]))[0]
        assert backend.batch_set_v1([k("page")], _indices(pool, [2])) == [True]
        _sentinel_fill(pool)
        got = backend.get(k("page"))
        assert got is not None, "get of a page written with batch_set_v1 missed"
        problem = mismatch("get after batch_set_v1", k("page"), got, want)
        assert problem is None, f"{problem}: the page changed after batch_set_v1 returned"

    def test_exists_agrees_with_get_after_set(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.exists(k("v")) is False and backend.get(k("v")) is None
        assert backend.set(k("v"), b"value")
        assert backend.exists(k("v")) is True
        assert backend.get(k("v")) is not None


class TestMiss:
    """A miss is a value (None / False / 0), never an exception."""

    def test_get_missing_returns_none(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.get(k("absent")) is None

    def test_get_into_missing_returns_none_out_untouched(
        self, backend: StorageBackend, k: Keyspace
    ) -> None:
        out = bytearray(b"\x5a" * 64)
        assert backend.get(k("absent"), out) is None
        assert out == bytearray(b"\x5a" * 64)

    def test_exists_missing_false(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.exists(k("absent")) is False

    def test_batch_exists_missing_zero(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.batch_exists(k.many("absent", 3)) == 0

    def test_batch_get_missing_all_false(self, backend: StorageBackend, k: Keyspace) -> None:
        keys = k.many("absent", 3)
        outs = [bytearray([SENTINEL]) * 8 for _ in keys]
        assert backend.batch_get(keys, outs) == [False] * 3
        untouched = [slot_problem(out, None) for out in outs]
        assert untouched == [None] * 3, f"batch_get of 3 absent keys: {untouched}"


class TestIdempotentSet:
    """Writing a key twice leaves one complete value, equal to one of those written."""

    def test_set_twice_keeps_one_complete_value(self, backend: StorageBackend, k: Keyspace) -> None:
        first, second = make_value("first", 3000), make_value("second", 5000)
        assert backend.set(k("v"), first)
        assert backend.set(k("v"), second)
        got = backend.get(k("v"))
        assert got is not None and _bytes(got) in (first, second)

    def test_set_same_value_twice_true(self, backend: StorageBackend, k: Keyspace) -> None:
        value = make_value("same", 1000)
        assert backend.set(k("v"), value) is True
        assert backend.set(k("v"), value) is True
        got = backend.get(k("v"))
        assert got is not None and _bytes(got) == value
