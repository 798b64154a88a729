"""The tier engine never computes on a page the store claimed but did not deliver."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import pytest

from hicache_storage import register_plugin, unregister_plugin
from hicache_storage.bench.engine import run_bench

from .test_bench import SMALL


@pytest.fixture
def broken_plugin() -> Iterator[None]:
    import tests.broken_backends.plugin as plugin

    register_plugin(sys.modules[plugin.__name__], name=plugin.__name__)
    yield
    unregister_plugin(sys.modules[plugin.__name__])


@pytest.mark.usefixtures("broken_plugin")
def test_a_store_claiming_unfilled_pages_costs_recomputes_not_tokens() -> None:
    config = dataclasses.replace(SMALL, backend="broken-claims-unfilled", backend_config=None)
    result = run_bench(config, runs=["L1+L2+L3", "L1+L2+L3-unverified"])
    verified = result.run("L1+L2+L3")
    counts = verified.storage_stats["verify"]
    assert counts["mismatched"] > 0 and counts["verified"] == 0
    assert verified.identical, "a page the store never delivered reached the model"
    assert verified.storage_hit_tokens == 0
    # Without the check the engine computes on whatever the slots held: the check is the reason.
    unverified = result.run("L1+L2+L3-unverified")
    assert "verify" not in unverified.storage_stats
    assert unverified.storage_hit_tokens > 0 and not unverified.identical
