"""``hicache_storage.engine`` exports what users write, each name the class its module defines."""

from __future__ import annotations

import importlib

import pytest

import hicache_storage.engine as engine

DEFINED_IN = {
    "Engine": "engine",
    "TierCache": "cache",
    "CacheConfig": "cache_config",
    "WriteConfig": "cache_config",
    "PrefetchConfig": "cache_config",
    "ThreadConfig": "cache_config",
    "TransferConfig": "cache_config",
    "LlamaModel": "model",
    "ModelConfig": "model",
    "Scheduler": "scheduler",
    "Request": "scheduler",
    "StepRecord": "scheduler",
    "InvalidRequestError": "errors",
    "PoolMismatchError": "errors",
    "RequestFailedError": "errors",
    "RequestTypeError": "errors",
    "StorageBugError": "errors",
    "build_cache": "build",
}


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_export_is_the_modules_class(name: str) -> None:
    module = importlib.import_module(f"hicache_storage.engine.{DEFINED_IN[name]}")
    assert getattr(engine, name) is getattr(module, name)


def test_all_lists_exactly_the_exports() -> None:
    assert sorted(engine.__all__) == sorted(DEFINED_IN)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        engine.Nope  # noqa: B018
