"""A store whose every call fails after a delay (an outage) is shed as fast as a slow one.

Before, such a store was never measured (its queries found nothing, so nothing was read), so the
``adaptive`` policy never priced it out: a run of the tiny model waited 2.1 s for host room
behind 21 writes that could only fail. Now a call that delivered nothing is a measurement (an
infinite rate a page), the store is bypassed, writes to it are shed and counted with their
reason, and the scheduler waits for none of its writes: under ``adaptive`` a store is waited
for only once it is measured to keep up with its writer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.config import FaultConfig, FaultRule, LayerConfig
from hicache_storage.engine.cache_config import PrefetchConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.health import Bypass, bypass
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.scheduler import Request
from hicache_storage.layers import ForwardingBackend
from hicache_storage.planner.rates import READ_TTL_S, CostModel

from ._child import PAGE, build_cache, conversations

DELAY_S = 0.1
"""What every call of the failing store takes before it fails (its deadline)."""

CLIENTS = 4
ROUNDS = 4


class Timed(ForwardingBackend):
    """Counts the writes and existence queries that reach the store, and the writes' seconds."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.writes = 0
        self.queries = 0
        self.write_s = 0.0
        self._lock = threading.Lock()

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        began = time.monotonic()
        try:
            return self.inner.batch_set_v1(keys, host_indices)
        finally:
            with self._lock:
                self.writes += 1
                self.write_s += time.monotonic() - began

    def batch_exists(self, keys: Sequence[str]) -> int:
        with self._lock:
            self.queries += 1
        return self.inner.batch_exists(keys)


def outage() -> Timed:
    """Return a memory store whose every call sleeps ``DELAY_S``, then fails every key."""
    rule = FaultRule(failure_rate=1.0, delay_s=DELAY_S)
    return Timed(create_backend("memory", layers=LayerConfig(faults=FaultConfig(default=rule))))


def test_a_failing_store_is_shed_and_no_step_waits_behind_its_writes(model: LlamaModel) -> None:
    prompts = conversations(rounds=ROUNDS, clients=CLIENTS, seed=5)
    expected = [model.generate_no_cache(p, 4) for p in prompts]
    backend = outage()
    cache = build_cache(64, 48, backend, prefetch=PrefetchConfig(PrefetchPolicy.ADAPTIVE))
    with Engine(model, cache) as engine:
        for r in range(ROUNDS):
            batch = [Request(p, 4) for p in prompts[r * CLIENTS : (r + 1) * CLIENTS]]
            got = [request.output for request in engine.serve(batch)]
            assert got == expected[r * CLIENTS : (r + 1) * CLIENTS]
            if r == 0:  # the scheduler waits for no write: the later rounds come after one
                deadline = time.monotonic() + 30.0
                while not cache.costs.failing:
                    assert time.monotonic() < deadline, "the first write never returned"
                    time.sleep(0.01)
        assert cache.costs.failing and cache.decisions.bypass() is Bypass.FAILING
    stats = cache.stats
    assert stats.writes_shed_failing > 0 and stats.writes_shed >= stats.writes_shed_failing
    assert stats.prefetch_priced_out > 0, "once failing, the store is not even asked"
    # The writer made its first call before anything was known; the first failure bypassed the
    # store (no further write: the run is far shorter than READ_TTL_S). The scheduler waited
    # for none: a store whose writes are unmeasured is not waited for.
    assert backend.writes == 1, f"{backend.writes} writes reached a store known to fail"
    assert stats.host_room_wait_s == 0, (
        f"the scheduler waited {stats.host_room_wait_s:.2f} s for host room behind writes "
        f"that took {backend.write_s:.2f} s"
    )
    assert stats.storage_hit_tokens == 0 and stats.pages_stored == 0
    backend.close()


def test_a_call_that_delivered_nothing_is_an_infinite_rate_one_among_fast_ones_is_not() -> None:
    now = [0.0]
    costs = CostModel(clock=lambda: now[0])
    costs.observe_forward(1000, 1.0)  # a page recomputes in 4 ms
    costs.observe_failure()
    assert costs.failing and bypass(costs, PAGE, 0.0) is Bypass.FAILING
    assert costs.read_s_per_page == float("inf")
    for _ in range(4):
        costs.observe_read(1, 1e-4)
    assert not costs.failing and bypass(costs, PAGE, 0.0) is None, "one failure among 4 fast"
    costs.observe_failure()
    costs.observe_failure()
    assert not costs.failing, "2 of the last 5 calls delivered nothing"
    costs.observe_failure()
    assert costs.failing, "3 of the last 5 calls delivered nothing"
    now[0] += READ_TTL_S + 1
    assert costs.read_s_per_page is None and not costs.failing, "forgotten: measured again"


def test_failed_writes_count_only_while_no_read_delivers() -> None:
    costs = CostModel()
    costs.observe_read(1, 1e-4)
    for _ in range(10):
        costs.observe_failure(write=True)  # a store mounted read-only: reads still serve
    assert not costs.failing and costs.read_s_per_page == pytest.approx(1e-4)
    outage_costs = CostModel()
    outage_costs.observe_failure(write=True)  # nothing read: the writes are the evidence
    assert outage_costs.failing


def test_a_failing_store_is_left_alone_only_under_adaptive(model: LlamaModel) -> None:
    backend = outage()
    cache = build_cache(64, 48, backend, prefetch=PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE))
    cache.costs.observe_failure()
    bypassed = cache.decisions.bypassed()
    assert cache.costs.failing and not bypassed, "SGLang's policies write every page"
    assert cache.io is not None and not cache.io.shed_failing
    cache.close()
    backend.close()
