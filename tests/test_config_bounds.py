"""Every duration and size is bounded where it is parsed (issue 48, item 10).

A value past a bound, infinite or NaN is a one-line ``ConfigError`` when the config is read (exit
status 2 from the CLI), never a raw ``OverflowError`` from a lock or a socket once calls run, nor
an allocator's traceback once a model is built.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from click.testing import CliRunner
from msgspec import inspect

from hicache_storage import create_backend
from hicache_storage.bench.engine import BenchConfig, run_bench
from hicache_storage.cli import main
from hicache_storage.config import LayerConfig, check_duration, convert
from hicache_storage.engine import build
from hicache_storage.engine.build import check_memory, weight_bytes
from hicache_storage.engine.cache import CacheConfig
from hicache_storage.engine.cache_config import ThreadConfig, TransferConfig, WriteConfig
from hicache_storage.engine.model import LlamaModel, ModelConfig
from hicache_storage.engine.policies import PrefetchTimeout
from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import MAX_BYTES, MAX_TIMEOUT_S, MAX_TTL_S
from hicache_storage.registry import registered_backends

from .helpers import builtin_backends

VALID: dict[str, dict[str, Any]] = {
    "3fs": {"path": "/tmp/hicache-bounds-3fs"},
    "chain": {"tiers": [{"backend": "memory"}]},
    "file": {"root": "/tmp/hicache-bounds-file"},
    "fsspec": {"url": "memory://hicache-bounds"},
    "memory": {},
    "mooncake": {"master": "127.0.0.1:50051"},
    "process": {"backend": "memory"},
    "redis": {"url": "redis://127.0.0.1:6379/0"},
    "s3": {"bucket": "hicache-bounds"},
}
"""The smallest valid options of each built-in backend; a field is probed by changing it alone."""

HUGE_FLOATS = (math.inf, -math.inf, math.nan, 1e300, -1.0)
HUGE_INTS = ((1 << 63) - 1, -(1 << 63))


def _scalars(field: inspect.Field) -> set[type[inspect.Type]]:
    types = field.type.types if isinstance(field.type, inspect.UnionType) else (field.type,)
    return {type(t) for t in types}


def _probes(schema: type[msgspec.Struct]) -> list[tuple[str, object]]:
    """Each numeric field of ``schema`` with every value no config may hold."""
    probes: list[tuple[str, object]] = []
    for field in inspect.type_info(schema).fields:  # type: ignore[union-attr]
        kinds = _scalars(field)
        if inspect.FloatType in kinds:
            probes += [(field.name, value) for value in HUGE_FLOATS]
        if inspect.IntType in kinds:
            probes += [(field.name, value) for value in HUGE_INTS]
    return probes


@pytest.mark.parametrize("name", builtin_backends())
def test_every_backend_names_its_smallest_valid_options(name: str) -> None:
    assert name in VALID, f"add the smallest valid options of backend {name!r} to VALID"
    schema = registered_backends()[name].load_config_type()
    convert(VALID[name], schema, f"{name} backend options")


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        (name, field, value)
        for name, spec in sorted(registered_backends().items())
        if name in VALID
        for field, value in _probes(spec.load_config_type())
    ],
)
def test_every_numeric_backend_option_refuses_what_no_deployment_uses(
    name: str, field: str, value: object
) -> None:
    """Every float option refuses infinity, NaN, 1e300 and -1; every int one, 64-bit extremes."""
    schema = registered_backends()[name].load_config_type()
    with pytest.raises(ConfigError, match=field) as caught:
        convert({**VALID[name], field: value}, schema, f"{name} backend options")
    assert "\n" not in str(caught.value)


def _layer_records() -> list[type[msgspec.Struct]]:
    """Every record the layer settings nest (fault rules, health probing ...), found by walking."""
    found: list[type[msgspec.Struct]] = []
    pending: list[inspect.Type] = [inspect.type_info(LayerConfig)]
    while pending:
        info = pending.pop()
        if isinstance(info, inspect.UnionType):
            pending += info.types
        elif isinstance(info, inspect.DictType):
            pending.append(info.value_type)
        elif isinstance(info, inspect.StructType) and info.cls not in found:
            found.append(info.cls)
            pending += [field.type for field in info.fields]
    return found


@pytest.mark.parametrize(
    ("schema", "field", "value"),
    [
        (schema, field, value)
        for schema in _layer_records()
        for field, value in _probes(schema)
        if field.endswith("_s")
    ],
)
def test_every_layer_duration_is_bounded(
    schema: type[msgspec.Struct], field: str, value: object
) -> None:
    required = {"QuotaConfig": {"bytes": 1}}.get(schema.__name__, {})
    with pytest.raises(ConfigError, match=field):
        convert({**required, field: value}, schema, "layer settings")


def test_the_bounds_are_far_inside_what_waits_accept() -> None:
    """The documented limits: an hour for a timeout, ten years for an age, 1 PiB for a size.

    Each accepted value must be one a lock, a condition and ``time.sleep`` take without
    ``OverflowError``.
    """
    assert MAX_TIMEOUT_S == 3600 and MAX_TTL_S == 10 * 365 * 86400 and MAX_BYTES == 1 << 50
    assert MAX_TTL_S < threading.TIMEOUT_MAX
    assert threading.Lock().acquire(timeout=MAX_TTL_S)
    assert not threading.Event().wait(timeout=0) and time.monotonic() + MAX_TTL_S < math.inf


@pytest.mark.parametrize("value", [1e300, math.inf, math.nan, 0, -1, True, "5"])
def test_check_duration_is_one_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match="start_timeout_s") as caught:
        check_duration("start_timeout_s", value)
    assert "\n" not in str(caught.value)
    check_duration("start_timeout_s", MAX_TIMEOUT_S)


@pytest.mark.parametrize("field", ["call_timeout_s", "start_timeout_s"])
def test_a_process_backend_past_the_bound_is_refused_before_it_starts(field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be > 0 and at most 3600"):
        create_backend("process", {"backend": "memory", field: 1e300})


def test_process_threads_are_bounded() -> None:
    with pytest.raises(ConfigError, match="threads"):
        create_backend("process", {"backend": "memory", "threads": 1 << 40})


def test_check_process_with_a_huge_timeout_is_one_line_and_exit_2() -> None:
    config = json.dumps({"backend": "memory", "call_timeout_s": 1e300})
    result = CliRunner().invoke(main, ["check", "process", "--config", config])
    assert result.exit_code == 2, result.output
    assert "call_timeout_s" in result.stderr
    assert "Traceback" not in result.output and "OverflowError" not in result.output


BENCH_BOUNDS = [
    ("read_delay_s", 1e300),
    ("read_delay_s", math.inf),
    ("read_delay_s", math.nan),
    ("workload.arrival_rate", math.inf),
    ("workload.arrival_rate", math.nan),
    ("write.linger_s", 1e300),
    ("prefetch.timeout.base_s", math.inf),
]
"""The bench's durations and rates: its own, its workload's, and the cache's through the bench."""


@pytest.mark.parametrize(("path", "value"), BENCH_BOUNDS)
def test_bench_durations_and_rates_are_bounded(path: str, value: float) -> None:
    with pytest.raises(ConfigError, match=path.rsplit(".", 1)[-1]):
        BenchConfig().with_settings({path: value})


@pytest.mark.parametrize(("path", "value"), BENCH_BOUNDS)
def test_engine_bench_past_a_bound_is_one_line_and_exit_2(path: str, value: float) -> None:
    # JSON has no infinity or NaN: those go as text (1e999 overflows), which no float field takes.
    text = {math.inf: "1e999", 1e300: "1e300"}.get(value, "NaN")
    result = CliRunner().invoke(main, ["engine", "bench", "--set", f"{path}={text}"])
    assert result.exit_code == 2, result.output
    assert path.rsplit(".", 1)[-1] in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("field", ["base_s", "per_page_s"])
def test_prefetch_timeouts_are_bounded(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        PrefetchTimeout(**{field: 1e300})
    PrefetchTimeout(**{field: 0.0})


@pytest.mark.parametrize(
    ("group", "field", "value"),
    [
        (ThreadConfig, "switch_interval_s", 1e300),
        (ThreadConfig, "switch_interval_s", math.inf),
        (None, "close_timeout_s", 1e300),
        (TransferConfig, "load_max_gbps", math.nan),
        (TransferConfig, "backup_max_gbps", math.inf),
        (WriteConfig, "batch_bytes", (1 << 63) - 1),
    ],
)
def test_cache_durations_sizes_and_rates_are_bounded(
    group: type | None, field: str, value: float
) -> None:
    with pytest.raises(ConfigError, match=field):
        if group is None:
            CacheConfig(8, **{field: value})
        else:
            group(**{field: value})


def _tensors(model: LlamaModel) -> list[torch.Tensor]:
    layers = [t for layer in model.layers for t in vars(layer).values()]
    return [model.embedding, model.final_norm, model.lm_head, *layers]


@pytest.mark.parametrize(
    "shape",
    [ModelConfig.tiny(), ModelConfig.tiny(dtype=torch.bfloat16, vocab_size=300, intermediate=96)],
)
def test_weight_bytes_are_the_models_own(shape: ModelConfig) -> None:
    model = LlamaModel(shape)
    assert weight_bytes(shape) == sum(t.numel() * t.element_size() for t in _tensors(model))


def _impossible_model(tmp_path: Path) -> str:
    """A config.json whose embedding alone would take petabytes (a hidden size of 10^12)."""
    path = tmp_path / "config.json"
    config = {
        "model_type": "llama",
        "hidden_size": 10**12,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "intermediate_size": 128,
    }
    path.write_text(json.dumps(config))
    return str(path)


def test_an_impossible_model_is_refused_before_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr("hicache_storage.bench.engine.LlamaModel", never)
    config = BenchConfig.for_model(_impossible_model(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match=r"does not fit: weights .* but RAM has"):
        run_bench(config)


def test_engine_bench_of_an_impossible_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["engine", "bench", "--model", _impossible_model(tmp_path), "--force"]
    )
    assert result.exit_code == 2, result.output
    assert "does not fit" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_pools_larger_than_ram_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = ModelConfig.tiny()
    kv = shape.kv_bytes_per_token
    monkeypatch.setattr(build, "host_memory_bytes", lambda: 1000 * kv)
    check_memory(shape, "cpu", device_tokens=400, host_tokens=600, weights=False)
    with pytest.raises(ConfigError, match=r"device pool .* and host pool .* but RAM has"):
        check_memory(shape, "cpu", device_tokens=400, host_tokens=608, weights=False)


def test_on_a_gpu_the_device_and_the_host_are_checked_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weights and device pool against the GPU; the host pool against the host's RAM."""
    shape = ModelConfig.tiny()
    kv = shape.kv_bytes_per_token
    weights = weight_bytes(shape)
    monkeypatch.setattr(build, "host_memory_bytes", lambda: 1000 * kv)
    monkeypatch.setattr(build, "_device_memory_bytes", lambda device: weights + 100 * kv)
    check_memory(shape, "cuda", device_tokens=100, host_tokens=1000)
    with pytest.raises(ConfigError, match=r"weights .* and device pool .* but cuda has"):
        check_memory(shape, "cuda", device_tokens=108, host_tokens=8)
    with pytest.raises(ConfigError, match=r"host pool .* but host RAM has"):
        check_memory(shape, "cuda", device_tokens=8, host_tokens=1008)


def test_build_cache_checks_its_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = ModelConfig.tiny()
    monkeypatch.setattr(build, "host_memory_bytes", lambda: 64 * shape.kv_bytes_per_token)
    with pytest.raises(ConfigError, match="does not fit"):
        build.build_cache(shape, CacheConfig(8), device_tokens=64, host_tokens=64)
