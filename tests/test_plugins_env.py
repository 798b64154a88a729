"""A plugin named in ``HICACHE_PLUGINS`` works wherever the variable is honoured.

The variable names modules to load, not a config field: ``load_config`` (which SGLang's and
vLLM's adapters call) must not read it as ``plugins``.
"""

from __future__ import annotations

from importlib.metadata import version
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


@pytest.mark.parametrize(
    ("line", "expected"), [("", "unknown"), ('__version__ = "9.8.7"', "9.8.7")]
)
def test_a_run_time_plugin_reports_its_own_version_never_the_sdks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, expected: str
) -> None:
    from hicache_storage.conformance.factory import BackendFactory

    module = "hicache_test_versioned_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)
    (tmp_path / f"{module}.py").write_text(
        f"""{line}
from hicache_storage.backends.memory.backend import MemoryBackend
from hicache_storage.registry import BackendSpec, hookimpl


class Versioned(MemoryBackend):
    name = "versioned"


@hookimpl
def hicache_backends():
    return [BackendSpec(name="versioned", factory="{module}:Versioned",
                        config="hicache_storage.backends.memory.config:MemoryConfig")]
"""
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_ENV, module)
    monkeypatch.setattr(registry, "_REGISTRY", registry._Registry())
    assert BackendFactory("versioned").version() == expected
    assert BackendFactory("file").version() == version("hicache-storage")
