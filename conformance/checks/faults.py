"""Faults: injected load failures never give wrong bytes; a stopped server gives misses."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.config import FaultConfig, FaultRule
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    SLACK_S,
    _bytes,
    _expected_after_load,
    _indices,
    _pool,
    _random_fill,
    _raw,
    _sentinel_fill,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.server import (
    PausableServerControl,
    ServerControl,
    find_server_control,
)

__all__ = ["server_control", "TestFaults", "TestServerFaults"]


class TestFaults:
    """With injected load failures, every key loads correctly or reports a miss; never bad bytes."""

    def test_v1_faults_never_wrong_bytes(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        faults = FaultConfig(seed=1234, ops={"batch_get_v1": FaultRule(failure_rate=0.5)})
        layers = msgspec.structs.replace(hicache_factory.layers, faults=faults)
        with hicache_factory(layers) as instance:
            source = _pool("mha", "layer_first", pages=16)
            _random_fill(source, seed=99)
            keys = k.many("fault", 16)
            instance.register_host_pool(source)
            assert instance.batch_set_v1(keys, _indices(source, range(16))) == [True] * 16
            assert instance.batch_exists(keys) == 16
            target = _pool("mha", "layer_first", pages=16)
            _sentinel_fill(target)
            instance.register_host_pool(target)
            order = list(reversed(range(16)))
            hits = instance.batch_get_v1(keys, _indices(target, order))
            moves = [
                (src, dst) for src, dst, hit in zip(range(16), order, hits, strict=True) if hit
            ]
            assert torch.equal(_raw(target), _expected_after_load(target, source, moves, "mha"))
            cleanup(hicache_factory, instance, k)


def _server_timeout(control: ServerControl, options: dict[str, Any]) -> float:
    value = getattr(control, "timeout_s", None)
    if isinstance(value, (int, float)):
        return float(value)
    for name in ("deadline_s", "timeout_s", "op_timeout_s", "request_timeout_s", "timeout"):
        option = options.get(name)
        if isinstance(option, (int, float)) and not isinstance(option, bool):
            return float(option)
    return 5.0


@pytest.fixture
def server_control(hicache_factory: BackendFactory) -> Iterator[ServerControl]:
    """Yield the plugin-provided server control; skip when no plugin provides one."""
    control = find_server_control(hicache_factory.name, hicache_factory.options)
    if control is None:
        pytest.skip(
            f"no server control for backend {hicache_factory.name} "
            f"(provide the hicache_conformance_server hook)"
        )
    try:
        yield control
    finally:
        control.start()


def _calls_miss_in_time(
    control: ServerControl,
    factory: BackendFactory,
    k: Keyspace,
    fault: Callable[[], None],
    state: str,
) -> None:
    """Break the server with ``fault``; every call, single and batched, answers within the bound.

    Each answer is a miss or, where part of the store still answers (one node of a cluster
    paused), the correct value: never wrong bytes, never a write into the pool on a failed load.
    Batches span 32 keys so a client that retries key by key (or node by node) shows it.
    """
    layers = msgspec.structs.replace(factory.layers, degrade=True, faults=None)
    limit = _server_timeout(control, factory.options) + SLACK_S
    pool = _pool("mha", "layer_first", pages=40)
    many = k.many(f"{state}-many", 32)
    values = [b"%02d" % i for i in range(32)]
    with factory(layers) as instance:
        instance.register_host_pool(pool)
        assert instance.set(k("up"), b"before the outage")
        assert instance.batch_set(many, values) == [True] * 32
        fault()
        _sentinel_fill(pool)
        outs = [bytearray(2) for _ in many]
        into = bytearray(17)

        def batch_read() -> object:
            hits = instance.batch_get(many, outs)
            wrong = [i for i, hit in enumerate(hits) if hit and bytes(outs[i]) != values[i]]
            return f"wrong bytes for keys {wrong}" if wrong else len(hits) == 32

        def read() -> object:
            got = instance.get(k("up"))
            return got is None or _bytes(got) == b"before the outage"

        def read_into() -> object:
            got = instance.get(k("up"), into)
            return got is None or bytes(into) == b"before the outage"

        calls: dict[str, Callable[[], object]] = {
            "get": read,
            "get_into": read_into,
            "exists": lambda: isinstance(instance.exists(k("up")), bool),
            "set": lambda: isinstance(instance.set(k("down"), b"x"), bool),
            "batch_get": batch_read,
            "batch_set": lambda: (
                len(instance.batch_set([f"{key}-n" for key in many], [b"x"] * 32)) == 32
            ),
            "batch_exists": lambda: 0 <= instance.batch_exists(many) <= 32,
            # The stored values are not page-sized: every load is a miss, the pool untouched.
            "batch_get_v1": lambda: (
                instance.batch_get_v1(many, _indices(pool, range(32))) == [False] * 32
            ),
            "batch_set_v1": lambda: (
                len(
                    instance.batch_set_v1(
                        [f"{key}-v" for key in many],
                        _indices(pool, [32 + i % 8 for i in range(32)]),
                    )
                )
                == 32
            ),
        }
        for op, call in calls.items():
            start = time.monotonic()
            verdict = call()
            elapsed = time.monotonic() - start
            assert elapsed <= limit, (
                f"{op} took {elapsed:.2f}s with the server {state}; the bound is {limit:.2f}s "
                f"(the backend's deadline plus {SLACK_S:g}s): honour one overall per-call "
                f"deadline, including inside the client library's retries"
            )
            assert verdict is True, f"{op} with the server {state}: {verdict}"
        assert bool((_raw(pool) == SENTINEL).all()), f"a failed load wrote into the pool ({state})"


class TestServerFaults:
    """With the server down every call answers a miss in time; after a restart it works again."""

    def test_server_down_calls_miss_within_timeout(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        _calls_miss_in_time(server_control, hicache_factory, k, server_control.stop, "down")

    def test_server_paused_calls_miss_within_deadline(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        if not isinstance(server_control, PausableServerControl):
            pytest.skip("the server control has no pause()/resume()")
        try:
            _calls_miss_in_time(server_control, hicache_factory, k, server_control.pause, "paused")
        finally:
            server_control.resume()

    def test_server_restart_recovers(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        limit = _server_timeout(server_control, hicache_factory.options) + SLACK_S
        server_control.stop()
        backend.get(k("r"))
        server_control.start()
        deadline = time.monotonic() + 2 * limit
        while not backend.set(k("r"), b"after restart") and time.monotonic() < deadline:
            time.sleep(0.1)
        got = backend.get(k("r"))
        assert got is not None and _bytes(got) == b"after restart"
