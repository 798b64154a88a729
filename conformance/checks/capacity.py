"""Taking values out: eviction keeps a bounded store under its bound; ``delete``."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities
from hicache_storage.conformance.checks.common import MiB, _bytes, requires
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.conformance.workers import make_value
from hicache_storage.errors import UnsupportedOperationError

__all__ = ["TestBounded", "TestDelete"]


def _bound_of(instance: StorageBackend, factory: BackendFactory) -> int | None:
    for source in (instance.stats(), factory.options):
        value = source.get("max_bytes")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class TestBounded:
    """Usage stays under the configured bound while recent values stay readable."""

    @requires("bounded")
    def test_usage_stays_under_bound_recent_readable(
        self, backend: StorageBackend, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        bound = _bound_of(backend, hicache_factory)
        assert bound is not None, "a bounded backend must report max_bytes in stats() or options"
        if bound > 256 * MiB:
            pytest.skip(f"bound of {bound} bytes is too large to overfill quickly")
        chunk = max(1, bound // 16)
        keys = k.many("fill", 40)
        for key in keys:
            backend.set(key, make_value(key, chunk))
            stats = backend.stats()
            usage = stats.get("bytes")
            if not isinstance(usage, int):
                usage = sum(chunk for key2 in keys if backend.exists(key2))
            assert usage <= bound, f"usage {usage} exceeds bound {bound}"
        last = backend.get(keys[-1])
        assert last is not None and _bytes(last) == make_value(keys[-1], chunk)
        assert sum(backend.exists(key) for key in keys) < len(keys), "nothing was evicted"


class TestDelete:
    """``delete`` removes a key, reports whether it existed, and frees it for a new value."""

    @requires("delete")
    def test_delete_existing_removes_key(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("d"), b"value")
        assert backend.delete(k("d")) is True
        assert backend.exists(k("d")) is False and backend.get(k("d")) is None
        assert backend.batch_exists([k("d")]) == 0

    @requires("delete")
    def test_delete_missing_false(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.delete(k("absent")) is False

    @requires("delete")
    def test_set_after_delete_stores_new_value(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("d"), b"old value")
        assert backend.delete(k("d"))
        assert backend.set(k("d"), b"new")
        got = backend.get(k("d"))
        assert got is not None and _bytes(got) == b"new"

    def test_delete_unclaimed_raises_unsupported(
        self, backend: StorageBackend, capabilities: Capabilities, k: Keyspace
    ) -> None:
        if capabilities.delete:
            assert backend.delete(k("absent")) is False
        else:
            with pytest.raises(UnsupportedOperationError):
                backend.delete(k("absent"))
