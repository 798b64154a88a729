"""Registers the broken backends, as a pytest plugin: ``-p tests.broken_backends.plugin``.

Loaded into the suite's pytest process (with the repository root on ``PYTHONPATH``), it registers
itself with the hicache-storage registry before the suite resolves ``--hicache-backend``, so the
broken backends never appear in any other process.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from hicache_storage import BackendSpec, Capabilities, hookimpl, register_plugin, unregister_plugin

from . import HangsWhenDown

_MODULE = "tests.broken_backends"
_CONFIG = f"{_MODULE}:BrokenConfig"


def _spec(name: str, cls: str, description: str) -> BackendSpec:
    return BackendSpec(
        name=name,
        factory=f"{_MODULE}:{cls}",
        config=_CONFIG,
        capabilities=Capabilities(delete=True),  # what DictBackend claims
        description=description,
    )


SPECS = [
    _spec("broken-truncate", "Truncates", "truncates values over 64 KiB"),
    _spec("broken-prefix", "TotalNotPrefix", "batch_exists counts every hit"),
    _spec("broken-ignores-out", "IgnoresOut", "get(key, out) leaves out untouched"),
    _spec("broken-nonatomic", "NonAtomic", "set publishes before the value is whole"),
    _spec("broken-zombie", "Zombie", "delete says yes but the key stays"),
    _spec("broken-thread-leak", "Leaks", "every call starts a thread that outlives close()"),
    _spec("broken-hang", "HangsWhenDown", "blocks 30 s per call while its server is down"),
]


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the broken backends."""
    return list(SPECS)


class HangServer:
    """Stops and starts broken-hang's (in-process) server."""

    timeout_s = 1.0

    def stop(self) -> None:
        """Take the server down: every call now blocks."""
        HangsWhenDown.server_up.clear()

    def start(self) -> None:
        """Bring the server back."""
        HangsWhenDown.server_up.set()


@hookimpl
def hicache_conformance_server(name: str, options: dict[str, Any]) -> HangServer | None:
    """Hand the suite broken-hang's server control."""
    return HangServer() if name == "broken-hang" else None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register the broken backends with hicache-storage before the suite looks them up."""
    register_plugin(sys.modules[__name__], name="broken-backends")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Undo the registration."""
    unregister_plugin(sys.modules[__name__])
