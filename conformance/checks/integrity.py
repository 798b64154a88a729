"""Integrity: bytes corrupted on the medium read back as a miss, never as a hit.

The backend's plugin flips a stored byte through the ``hicache_conformance_corrupt`` hook (see
:mod:`hicache_storage.hookspecs`); a backend whose plugin does not implement it skips these checks.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import (
    MiB,
    _bytes,
    _indices,
    _pool,
    _random_fill,
    _sentinel_fill,
)
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.layers import ForwardingBackend
from hicache_storage.registry import _REGISTRY

__all__ = ["TestIntegrity"]

_SIZE = MiB + 13


def _corruptor(backend: StorageBackend) -> Callable[[str, int], bool]:
    """Return ``corrupt(key, offset)`` for the bare backend under ``backend``; skip if none."""
    bare = backend.unwrap() if isinstance(backend, ForwardingBackend) else backend
    hook = _REGISTRY.manager().hook.hicache_conformance_corrupt

    def corrupt(key: str, offset: int) -> bool:
        done: bool | None = hook(backend=bare, key=key, offset=offset)
        if done is None:
            pytest.skip(
                f"no plugin corrupts stored bytes of backend {backend.name!r} "
                f"(implement the hicache_conformance_corrupt hook)"
            )
        return bool(done)

    return corrupt


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class TestIntegrity:
    """A flipped byte anywhere in a value is a miss on every read path, and can be rewritten."""

    @pytest.mark.parametrize("where", ["first", "middle", "last"])
    def test_corrupted_value_is_a_miss(
        self, backend: StorageBackend, k: Keyspace, where: str
    ) -> None:
        corrupt = _corruptor(backend)
        offset = {"first": 0, "middle": _SIZE // 2, "last": _SIZE - 1}[where]
        value = _value(_SIZE, offset)
        reads: dict[str, Callable[[str], bool]] = {
            "get": lambda key: backend.get(key) is not None,
            "get_into": lambda key: backend.get(key, bytearray(_SIZE)) is not None,
            "batch_get": lambda key: backend.batch_get([key], [bytearray(_SIZE)])[0],
        }
        for path, read in reads.items():
            key = k(f"{where}-{path}")
            assert backend.set(key, value)
            assert corrupt(key, offset), f"the corruption hook found no stored {key!r}"
            assert not read(key), f"{path} returned a corrupted object (byte {offset}) as a hit"
            assert backend.get(key) is None, f"a corrupted object became a hit after {path}"
            assert backend.set(key, value), "a key whose object was corrupted cannot be set"
            got = backend.get(key)
            assert got is not None and _bytes(got) == value, (
                f"after a corrupted object was detected by {path}, a new set did not store the "
                f"new value: remove an object that fails verification"
            )

    def test_corrupted_page_is_a_miss_in_v1(self, backend: StorageBackend, k: Keyspace) -> None:
        corrupt = _corruptor(backend)
        source = _pool("mha", "layer_first", pages=4)
        _random_fill(source, seed=7)
        backend.register_host_pool(source)
        keys = k.many("page", 4)
        assert backend.batch_set_v1(keys, _indices(source, range(4))) == [True] * 4
        nbytes = source.page_nbytes
        for i, offset in enumerate((0, nbytes // 2, nbytes - 1)):
            assert corrupt(keys[i + 1], offset)
        target = _pool("mha", "layer_first", pages=4)
        _sentinel_fill(target)
        backend.register_host_pool(target)
        hits = backend.batch_get_v1(keys, _indices(target, range(4)))
        assert hits == [True, False, False, False], f"corrupted pages loaded as hits: {hits}"
        assert _bytes(target.get_data_page(0)) == _bytes(source.get_data_page(0)), (
            "the intact page loaded wrong bytes"
        )
