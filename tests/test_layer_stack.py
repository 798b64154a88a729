"""The layer stack by config: today's order by default, another order, a user's layer by path."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from typing_extensions import Buffer

from hicache_storage import open_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.config import FaultConfig, FaultRule, LayerConfig, load_config
from hicache_storage.errors import ConfigError, InjectedFaultError
from hicache_storage.factory import apply_layers
from hicache_storage.layers import (
    DegradeLayer,
    FaultInjectionLayer,
    ForwardingBackend,
    HealthLayer,
    MetricsLayer,
    ValidationLayer,
    VerifyLayer,
)


class CountingLayer(ForwardingBackend):
    """A user's layer: counts the keys every batch_get asks for."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.asked = 0

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        self.asked += len(keys)
        return self.inner.batch_get(keys, outs)


class NotALayer:
    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner


def chain(backend: StorageBackend) -> list[type]:
    out = []
    layer: object = backend
    while layer is not None:
        out.append(type(layer))
        layer = getattr(layer, "inner", None)
    return out


def test_the_default_stack_is_unchanged() -> None:
    assert chain(apply_layers(MemoryBackend())) == [
        ValidationLayer,
        DegradeLayer,
        HealthLayer,
        MetricsLayer,
        VerifyLayer,
        MemoryBackend,
    ]
    faults = FaultConfig(default=FaultRule(failure_rate=1.0))
    assert chain(apply_layers(MemoryBackend(), LayerConfig(faults=faults, metrics=False))) == [
        ValidationLayer,
        DegradeLayer,
        HealthLayer,
        VerifyLayer,
        FaultInjectionLayer,
        MemoryBackend,
    ]
    assert LayerConfig().layer_stack() == ("degrade", "health", "metrics", "verify")
    # health answers misses, so it applies only where degrade does
    assert LayerConfig(degrade=False, verify=False).layer_stack() == ("metrics",)
    assert LayerConfig(health=None).layer_stack() == ("degrade", "metrics", "verify")


def test_a_stack_orders_the_built_in_layers() -> None:
    layers = LayerConfig(stack=("metrics", "degrade"))
    assert chain(apply_layers(MemoryBackend(), layers)) == [
        ValidationLayer,
        MetricsLayer,
        DegradeLayer,
        MemoryBackend,
    ]
    bare = LayerConfig(stack=())
    assert chain(apply_layers(MemoryBackend(), bare)) == [ValidationLayer, MemoryBackend]


def test_a_stack_without_degrade_lets_failures_through() -> None:
    faults = FaultConfig(default=FaultRule(failure_rate=1.0))
    backend = apply_layers(MemoryBackend(), LayerConfig(stack=("faults",), faults=faults))
    with pytest.raises(InjectedFaultError):
        backend.exists("k")
    degraded = apply_layers(
        MemoryBackend(), LayerConfig(stack=("degrade", "faults"), faults=faults)
    )
    assert degraded.exists("k") is False


def test_a_users_layer_joins_by_config() -> None:
    path = f"{__name__}:CountingLayer"
    config = load_config(
        json.dumps({"backend": "memory", "layers": {"stack": ["degrade", path, "metrics"]}}),
        env={},
    )
    backend = open_backend(config)
    try:
        assert chain(backend) == [
            ValidationLayer,
            DegradeLayer,
            CountingLayer,
            MetricsLayer,
            MemoryBackend,
        ]
        assert backend.set("k", b"v")
        out = bytearray(1)
        assert backend.batch_get(["k", "j"], [out, bytearray(1)]) == [True, False]
        counting = backend.inner.inner  # type: ignore[attr-defined]
        assert isinstance(counting, CountingLayer)
        assert counting.asked == 2
        assert out == b"v"
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        (["degrade", "cache"], "unknown layer 'cache'"),
        (["metrics", "metrics"], "appears twice"),
        (["faults"], "exactly when faults is set"),
        (["no such thing"], "unknown layer"),
        (["health", "degrade"], "inside \\(after\\) 'degrade'"),
        (["metrics", "health"], "inside \\(after\\) 'degrade'"),
    ],
)
def test_a_bad_stack_is_a_config_error(stack: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(json.dumps({"layers": {"stack": stack}}), env={})


def test_a_stack_names_health_inside_degrade() -> None:
    layers = LayerConfig(stack=("degrade", "metrics", "health"))
    assert chain(apply_layers(MemoryBackend(), layers)) == [
        ValidationLayer,
        DegradeLayer,
        MetricsLayer,
        HealthLayer,
        MemoryBackend,
    ]
    with pytest.raises(ValueError, match="health is off"):
        LayerConfig(stack=("degrade", "health"), health=None)


def test_flags_beside_a_stack_are_refused() -> None:
    with pytest.raises(ConfigError, match="name the layers in stack"):
        load_config(json.dumps({"layers": {"stack": ["degrade"], "metrics": False}}), env={})


def test_faults_set_but_not_stacked_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly when faults is set"):
        LayerConfig(stack=("degrade",), faults=FaultConfig())


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.no_such_module:Layer", "could not be loaded"),
        (f"{__name__}:Missing", "could not be loaded"),
        (f"{__name__}:NotALayer", "is not a layer"),
    ],
)
def test_a_layer_that_cannot_be_built_is_a_config_error(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        apply_layers(MemoryBackend(), LayerConfig(stack=(path,)))
