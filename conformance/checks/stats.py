"""Statistics: the metrics layer's counters agree with the operations made."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import msgspec

from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup

__all__ = ["TestStats"]


class TestStats:
    """The metrics layer's counters agree with the operations made."""

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
