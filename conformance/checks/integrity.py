"""Integrity: corrupted or foreign bytes read back as a miss, never as a hit.

The backend's plugin flips a stored byte through the ``hicache_conformance_corrupt`` hook (see
:mod:`hicache_storage.hookspecs`); a backend whose plugin does not implement it skips those
checks. Objects written where deleted ones were (a reused inode, slot or offset) must read back
as themselves: a cache keyed by such an identity serves the deleted object's bytes.
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
    mismatch,
    page_bytes,
    requires,
)
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.conformance.workers import make_value
from hicache_storage.hostpool import HostKVPool
from hicache_storage.layers import ForwardingBackend
from hicache_storage.registry import _REGISTRY

__all__ = ["TestIdentityReuse", "TestIntegrity"]

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


_Read = Callable[[str], object]
"""Read a key on one path: what it returned on a hit (``None`` on a miss)."""


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


REUSE_CYCLES = 4
"""Delete-then-write cycles per value size; each cycle reads on one path, the next on another."""


def _reads(backend: StorageBackend, pool: HostKVPool, size: int) -> list[tuple[str, _Read]]:
    """Return the read paths for values of ``size`` (v1 too at the page size of ``pool``)."""

    def get_into(key: str) -> object:
        out = bytearray(size)
        return out if backend.get(key, out) is not None else None

    def batch_get(key: str) -> object:
        out = bytearray(size)
        return out if backend.batch_get([key], [out]) == [True] else None

    def get_v1(key: str) -> object:
        indices = _indices(pool, [0])
        hit = backend.batch_get_v1([key], indices) == [True]
        return page_bytes(pool, indices)[0] if hit else None

    reads: list[tuple[str, _Read]] = [
        ("get", backend.get),
        ("get into", get_into),
        ("batch_get", batch_get),
    ]
    return [*reads, ("batch_get_v1", get_v1)] if size == pool.page_nbytes else reads


def _read_back(op: str, read: _Read, key: str, value: bytes, when: str) -> None:
    got = read(key)
    problem = f"{op} of {key!r} missed" if got is None else mismatch(op, key, got, value)
    assert problem is None, f"{when}: {problem}"


class TestIdentityReuse:
    """A value written where a deleted one was reads back as itself, every byte, on every path."""

    @requires("delete")
    def test_delete_then_write_cycles_every_byte(
        self, backend: StorageBackend, k: Keyspace
    ) -> None:
        """Write A, read it, delete it, write B of the same size, read; then A again, new bytes.

        Freed space is what a medium hands out next (an inode, a slot, an offset), so B and the
        new A usually take the identity of the object deleted just before: a read cache keyed
        by that identity (inode and size, slot and generation) returns the old bytes. A must
        miss while deleted, and B and the new A must read back whole. Each cycle reads on one
        path (``get``, ``get`` into, ``batch_get``, ``batch_get_v1`` at the page size), so a
        cache of any one path is filled and then asked; cycles run at the pool's page size and
        at 64 KiB + 5.
        """
        pool = _pool("mla", "layer_first", pages=1)
        backend.register_host_pool(pool)
        a, b = k("reuse-a"), k("reuse-b")
        for size in (pool.page_nbytes, 64 * 1024 + 5):
            reads = _reads(backend, pool, size)
            for cycle in range(REUSE_CYCLES):
                op, read = reads[cycle % len(reads)]
                when = f"cycle {cycle} ({size} B values, read by {op})"
                old, new = make_value(f"{a}-{when}", size), make_value(f"{b}-{when}", size)
                assert backend.set(a, old), f"{when}: set({a!r}) failed"
                _read_back(op, read, a, old, f"{when}, before its delete")
                assert backend.delete(a), f"{when}: delete({a!r}) of a stored key said False"
                assert backend.set(b, new), f"{when}: set({b!r}) failed"
                assert backend.get(a) is None, f"{when}: {a!r} is still readable after its delete"
                _read_back(op, read, b, new, f"{when}, {b!r} written after {a!r}'s delete")
                assert backend.delete(b), f"{when}: delete({b!r}) of a stored key said False"
                renewed = make_value(f"{a}-{when}-again", size)
                assert backend.set(a, renewed), f"{when}: set({a!r}) after its delete failed"
                _read_back(op, read, a, renewed, f"{when}, {a!r} rewritten after its delete")
                assert backend.delete(a), f"{when}: delete({a!r}) of a stored key said False"
