"""Registers the broken backends, as a pytest plugin: ``-p tests.broken_backends.plugin``.

Loaded into the suite's pytest process (with the repository root on ``PYTHONPATH``), it registers
itself with the hicache-storage registry before the suite resolves ``--hicache-backend``, so the
broken backends never appear in any other process.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from hicache_storage import BackendSpec, hookimpl, register_plugin, unregister_plugin

from . import all_bugs
from .dict_bugs import HangsWhenDown


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the broken backends."""
    return [found.spec for found in all_bugs()]


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
