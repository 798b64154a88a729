"""The SGLang adapter's extra config must name its backend (a plugin's too), showing no secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.sglang import config_from
from hicache_storage.registry import registered_backends

from ..env_plugin import BACKEND, install_env_plugin
from .helpers import storage_config


@pytest.mark.parametrize(
    "extra",
    [{"options": {"url": "redis://127.0.0.1:6379/0"}}, {"config": {"options": {"root": "/kv"}}}],
    ids=["inline-options", "config-without-backend"],
)
def test_an_extra_config_without_backend_names_the_missing_key(
    extra: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HICACHE_BACKEND", raising=False)
    with pytest.raises(ConfigError) as caught:
        config_from(storage_config(extra))
    message = str(caught.value)
    assert "names no 'backend'; it is required" in message
    assert all(name in message for name in registered_backends())


def test_the_backend_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_BACKEND", "memory")
    assert config_from(storage_config({})).backend == "memory"


def test_the_adapters_config_masks_the_backends_secrets() -> None:
    extra = {"backend": "redis", "options": {"url": "redis://u:sglang-url-pass@h:6379/0"}}
    config = config_from(storage_config(extra))
    assert "sglang-url-pass" not in repr(config) and "sglang-url-pass" not in str(config)


def test_a_plugin_named_in_hicache_plugins_starts_in_sglang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_env_plugin(tmp_path, monkeypatch)
    assert config_from(storage_config({"backend": BACKEND})).backend == BACKEND
