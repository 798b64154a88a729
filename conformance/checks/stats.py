"""Statistics: the metrics layer's counters, and the backend's own, agree with the operations made.

A backend may report its own ``hits`` and ``misses`` in ``stats()`` (integers, per key looked
up). When it does, they are held to the same model as the metrics layer's: a read path moves
``hits`` by the keys it found and ``misses`` by the keys it did not; ``exists`` and
``batch_exists`` may leave them alone, but never count a miss as a hit or a hit as a miss.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import _indices, _pool
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.workers import make_value
from hicache_storage.hostpool import HostKVPool
from hicache_storage.layers import ForwardingBackend

__all__ = ["TestStats"]


_COUNTERS = ("hits", "misses")
_EXACT = ("get", "get into", "batch_get", "batch_get_v1")
_Read = Callable[[StorageBackend, Sequence[str]], Sequence[bool]]


def _reads(pool: HostKVPool) -> dict[str, tuple[str, _Read]]:
    """Return each read path (name -> metrics operation, call answering hit or not per key)."""
    size = pool.page_nbytes

    def outs(keys: Sequence[str]) -> list[bytearray]:
        return [bytearray(size) for _ in keys]

    def prefix(b: StorageBackend, keys: Sequence[str]) -> list[bool]:
        count = b.batch_exists(keys)
        return [i < count for i in range(len(keys))]

    return {
        "get": ("get", lambda b, keys: [b.get(key) is not None for key in keys]),
        "get into": ("get", lambda b, keys: [b.get(x, bytearray(size)) is not None for x in keys]),
        "batch_get": ("batch_get", lambda b, keys: b.batch_get(keys, outs(keys))),
        "batch_get_v1": (
            "batch_get_v1",
            lambda b, keys: b.batch_get_v1(keys, _indices(pool, range(len(keys)))),
        ),
        "exists": ("exists", lambda b, keys: [b.exists(key) for key in keys]),
        "batch_exists": ("batch_exists", prefix),
    }


def _metric_ops(instance: StorageBackend) -> dict[str, Any]:
    ops: dict[str, Any] = instance.stats()["metrics"]["ops"]
    return ops


def _moved(before: dict[str, Any], after: dict[str, Any], op: str) -> dict[str, int]:
    old, new = before.get(op, {}), after.get(op, {})
    return {name: new.get(name, 0) - old.get(name, 0) for name in ("hit", "miss")}


def _own_counters(bare: StorageBackend) -> dict[str, int]:
    """Return the backend's own ``hits``/``misses`` from ``stats()`` (those that are integers)."""
    stats = bare.stats()
    return {
        name: value
        for name in _COUNTERS
        if isinstance(value := stats.get(name), int) and not isinstance(value, bool)
    }


def _own_problems(
    name: str, before: dict[str, int], after: dict[str, int], model: dict[str, int]
) -> list[str]:
    """Say where the backend's own counters moved otherwise than ``model`` allows for ``name``."""
    problems = []
    for counter, outcome in zip(_COUNTERS, ("hit", "miss"), strict=True):
        if counter not in before or counter not in after:
            continue
        moved, want = after[counter] - before[counter], model[outcome]
        allowed = {want} if name in _EXACT else {0, want} if want else {0}
        if name == "batch_exists" and outcome == "miss":
            allowed = set(range(want + 1))
        if moved not in allowed:
            problems.append(
                f"stats()[{counter!r}] moved by {moved} after {name} of {model['hit']} stored and "
                f"{model['miss']} absent keys (expected {' or '.join(map(str, sorted(allowed)))})"
            )
    return problems


class TestStats:
    """The metrics layer's counters, and the backend's own hits and misses, match the calls."""

    def test_metrics_counters_match_ops(self, hicache_factory: BackendFactory, k: Keyspace) -> None:
        layers = msgspec.structs.replace(hicache_factory.layers, metrics=True, faults=None)
        with hicache_factory(layers) as instance:
            keys = k.many("m", 5)
            for key in keys:
                assert instance.set(key, b"metric")
            hits = [instance.get(key) is not None for key in keys[:3]]
            misses = [instance.get(k(f"miss{i}")) is None for i in range(2)]
            assert all(hits) and all(misses)
            assert instance.exists(keys[0]) and not instance.exists(k("miss0"))
            assert instance.batch_exists([*keys[:2], k("miss1"), keys[3]]) == 2
            ops = instance.stats()["metrics"]["ops"]
            cleanup(hicache_factory, instance, k)
        assert ops["set"]["calls"] == 5 and ops["set"].get("ok", 0) == 5
        assert ops["get"]["calls"] == 5
        assert ops["get"].get("hit", 0) == 3 and ops["get"].get("miss", 0) == 2
        assert ops["exists"].get("hit", 0) == 1 and ops["exists"].get("miss", 0) == 1
        assert ops["batch_exists"]["calls"] == 1
        assert ops["batch_exists"].get("hit", 0) == 2 and ops["batch_exists"].get("miss", 0) == 2

    def test_hit_miss_counters_match_model_every_read_path(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        """Every read path, on keys all stored then all absent, against a model of the calls.

        The metrics layer's ``hit``/``miss`` of each operation must move by exactly the keys
        found and not found; so must the backend's own ``hits``/``misses`` (read from the bare
        backend's ``stats()``, when it reports them) on ``get``, ``get`` into, ``batch_get`` and
        ``batch_get_v1``, while ``exists`` and ``batch_exists`` may leave them unmoved.
        """
        layers = msgspec.structs.replace(hicache_factory.layers, metrics=True, faults=None)
        pool = _pool("mla", "layer_first", pages=4)
        stored, absent = k.many("hit", 3), k.many("miss", 2)
        wrong: list[str] = []
        with hicache_factory(layers) as instance:
            bare = instance.unwrap() if isinstance(instance, ForwardingBackend) else instance
            instance.register_host_pool(pool)
            for key in stored:
                assert instance.set(key, make_value(key, pool.page_nbytes)), f"set({key!r}) failed"
            try:
                for name, (op, read) in _reads(pool).items():
                    for keys, found in ((stored, True), (absent, False)):
                        own, ops = _own_counters(bare), _metric_ops(instance)
                        answers = list(read(instance, keys))
                        assert answers == [found] * len(keys), (
                            f"{name} of {'stored' if found else 'absent'} keys answered {answers}"
                        )
                        n = len(keys)
                        model = {"hit": n, "miss": 0} if found else {"hit": 0, "miss": n}
                        moved = _moved(ops, _metric_ops(instance), op)
                        if moved != model:
                            wrong.append(f"metrics {op!r} moved {moved} after {name}, not {model}")
                        wrong.extend(_own_problems(name, own, _own_counters(bare), model))
                if instance.capabilities.delete:
                    ops = _metric_ops(instance)
                    deleted = [instance.delete(key) for key in (*stored, *absent)]
                    assert deleted == [True, True, True, False, False], f"delete said {deleted}"
                    moved = _moved(ops, _metric_ops(instance), "delete")
                    if moved != {"hit": 3, "miss": 2}:
                        wrong.append(f"metrics 'delete' moved {moved} after 3 hits and 2 misses")
            finally:
                cleanup(hicache_factory, instance, k)
        assert not wrong, f"{len(wrong)} counters disagree with the calls made: {'; '.join(wrong)}"
