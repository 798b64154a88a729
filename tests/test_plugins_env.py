"""A plugin named in ``HICACHE_PLUGINS`` works wherever the variable is honoured.

The variable names modules to load, not a config field: ``load_config`` (which SGLang's and
vLLM's adapters call) must not read it as ``plugins``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage import registry
from hicache_storage.config import RESERVED_ENV, env_overrides, load_config
from hicache_storage.factory import open_backend

from .env_plugin import BACKEND, install_env_plugin


def test_plugins_env_is_not_a_config_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_env_plugin(tmp_path, monkeypatch)
    assert registry.PLUGINS_ENV in RESERVED_ENV
    assert env_overrides({registry.PLUGINS_ENV: "a,b"}) == {}
    assert load_config({"backend": BACKEND}).backend == BACKEND


def test_a_plugin_from_the_env_opens_through_load_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_env_plugin(tmp_path, monkeypatch)
    monkeypatch.setenv("HICACHE_BACKEND", BACKEND)
    with open_backend() as backend:
        assert backend.set("k", b"v")
        assert backend.get("k") == b"v"
