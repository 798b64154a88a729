"""A plugin module that ``HICACHE_PLUGINS`` names, written for a test and put on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hicache_storage import registry

__all__ = ["BACKEND", "install_env_plugin"]

BACKEND = "env-plugin"
"""The backend the plugin registers: the memory backend under another name."""

PLUGIN = f"""
from hicache_storage.registry import BackendSpec, hookimpl


@hookimpl
def hicache_backends():
    return [
        BackendSpec(
            name={BACKEND!r},
            factory="hicache_storage.backends.memory.backend:MemoryBackend",
            config="hicache_storage.backends.memory.config:MemoryConfig",
        )
    ]
"""


def install_env_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Write the plugin into ``tmp_path``, put it on ``sys.path`` and name it in the variable.

    The process-wide registry is swapped for a fresh one, so the variable is read again.
    """
    module = "hicache_test_env_plugin_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setenv(registry.PLUGINS_ENV, module)
    monkeypatch.setattr(registry, "_REGISTRY", registry._Registry())
    return module
