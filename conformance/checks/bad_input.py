"""Caller mistakes: malformed keys and values, read-only buffers, use after close."""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.conformance.checks.common import _indices, _pool
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace
from hicache_storage.errors import BackendClosedError, InvalidKeyError, InvalidValueError

__all__ = ["TestBadInput"]


def _options_root(factory: BackendFactory) -> str | None:
    root = factory.options.get("root")
    return str(root) if isinstance(root, str) else None


def _names_under(root: str) -> set[str]:
    found: set[str] = set()
    parent = os.path.dirname(os.path.abspath(root))
    with contextlib.suppress(OSError):
        found.update(os.path.join(parent, n) for n in os.listdir(parent))
    for dirpath, dirnames, filenames in os.walk(root):
        found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return found


INVALID_KEYS: dict[str, Callable[[str], object]] = {
    "traversal": lambda p: f"../{p}x",
    "separator": lambda p: f"{p}a/b",
    "dotdot": lambda p: "..",
    "empty": lambda p: "",
    "nul": lambda p: f"{p}a\x00b",
    "too_long": lambda p: p + "a" * (201 - len(p)),
    "non_str": lambda p: 12345,
    "leading_dot": lambda p: f".{p}x",
}

KEY_OPS: dict[str, Callable[[StorageBackend, Any], object]] = {
    "set": lambda b, key: b.set(key, b"x"),
    "get": lambda b, key: b.get(key),
    "get_into": lambda b, key: b.get(key, bytearray(1)),
    "exists": lambda b, key: b.exists(key),
    "batch_set": lambda b, key: b.batch_set([key], [b"x"]),
    "batch_get": lambda b, key: b.batch_get([key], [bytearray(1)]),
    "batch_exists": lambda b, key: b.batch_exists([key]),
    "delete": lambda b, key: b.delete(key),
}


class TestBadInput:
    """Malformed keys and values are refused with a typed error and nothing is written."""

    @pytest.mark.parametrize("op", list(KEY_OPS))
    @pytest.mark.parametrize("case", list(INVALID_KEYS))
    def test_invalid_key_refused(
        self,
        backend: StorageBackend,
        hicache_factory: BackendFactory,
        k: Keyspace,
        case: str,
        op: str,
    ) -> None:
        key = INVALID_KEYS[case](k.prefix)
        root = _options_root(hicache_factory)
        before_names = _names_under(root) if root else set()
        before_objects = backend.stats().get("objects")
        with pytest.raises(InvalidKeyError):
            KEY_OPS[op](backend, key)
        if root:
            added = {p for p in _names_under(root) - before_names if k.prefix in p}
            assert not added, f"refused key left files behind: {sorted(added)}"
        assert backend.stats().get("objects") == before_objects

    @pytest.mark.parametrize(
        "case",
        ["str", "int", "list", "none", "numpy_noncontiguous", "torch_noncontiguous"],
    )
    def test_invalid_value_refused(self, backend: StorageBackend, k: Keyspace, case: str) -> None:
        values: dict[str, object] = {
            "str": "text",
            "int": 12345,
            "list": [1, 2, 3],
            "none": None,
            "numpy_noncontiguous": np.arange(64, dtype=np.uint8)[::2],
            "torch_noncontiguous": torch.arange(64, dtype=torch.uint8).view(8, 8).t(),
        }
        with pytest.raises(InvalidValueError):
            backend.set(k("v"), values[case])  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError):
            backend.batch_set([k("v")], [values[case]])  # type: ignore[list-item]
        assert backend.exists(k("v")) is False

    def test_get_into_readonly_out_refused(self, backend: StorageBackend, k: Keyspace) -> None:
        assert backend.set(k("v"), b"abcd")
        with pytest.raises(InvalidValueError):
            backend.get(k("v"), b"\x00" * 4)

    @pytest.mark.parametrize(
        "op",
        [
            *KEY_OPS,
            "clear",
            "register_host_pool",
            "batch_get_v1",
            "batch_set_v1",
        ],
    )
    def test_use_after_close_refused(
        self, hicache_factory: BackendFactory, k: Keyspace, op: str
    ) -> None:
        instance = hicache_factory()
        pool = _pool("mha", "layer_first")
        instance.register_host_pool(pool)
        instance.close()
        calls: dict[str, Callable[[], object]] = {
            **{name: functools.partial(f, instance, k("v")) for name, f in KEY_OPS.items()},
            "clear": instance.clear,
            "register_host_pool": lambda: instance.register_host_pool(pool),
            "batch_get_v1": lambda: instance.batch_get_v1([k("v")], _indices(pool, [0])),
            "batch_set_v1": lambda: instance.batch_set_v1([k("v")], _indices(pool, [0])),
        }
        with pytest.raises(BackendClosedError):
            calls[op]()

    def test_double_close_harmless(self, hicache_factory: BackendFactory) -> None:
        instance = hicache_factory()
        instance.close()
        instance.close()
        assert instance.closed is True
        assert isinstance(instance.stats(), dict)
