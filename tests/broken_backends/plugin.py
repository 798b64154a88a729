"""The hicache plugin of the broken backends and of the reference backend they start from.

``tests/test_teeth.py`` names it in ``HICACHE_PLUGINS`` (with the repository root on
``PYTHONPATH``), so the suite's process and its worker processes find these backends and no
other process does. Loaded with ``pytest -p tests.broken_backends.plugin`` instead, it registers
itself in that pytest process only (enough for backends the multi-process checks skip).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from hicache_storage import BackendSpec, hookimpl, register_plugin, unregister_plugin
from hicache_storage.registry import PLUGINS_ENV

from . import REFERENCE, all_bugs
from .deadline_bugs import DEADLINE_S, SERVING
from .dict_bugs import HangsWhenDown


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the broken backends."""
    return [REFERENCE, *(found.spec for found in all_bugs())]


class HangServer:
    """Stops and starts broken-hang's (in-process) server."""

    timeout_s = 1.0

    def stop(self) -> None:
        """Take the server down: every call now blocks."""
        HangsWhenDown.server_up.clear()

    def start(self) -> None:
        """Bring the server back."""
        HangsWhenDown.server_up.set()


class PausableServer:
    """Pauses, resumes, stops and starts the deadline bugs' (in-process) server."""

    timeout_s = DEADLINE_S

    def stop(self) -> None:
        """Take the server down: every call waits out its deadline."""
        SERVING.clear()

    def start(self) -> None:
        """Bring the server back."""
        SERVING.set()

    pause = stop
    resume = start


@hookimpl
def hicache_conformance_server(
    name: str, options: dict[str, Any]
) -> HangServer | PausableServer | None:
    """Hand the suite the server control of broken-hang or of a deadline bug."""
    if name == "broken-hang":
        return HangServer()
    return PausableServer() if name.startswith("broken-late-") else None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register the broken backends before the suite looks them up (unless the env did)."""
    if __name__ not in os.environ.get(PLUGINS_ENV, ""):
        register_plugin(sys.modules[__name__], name=__name__)
        config.add_cleanup(lambda: unregister_plugin(sys.modules[__name__]))
