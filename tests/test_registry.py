"""The registry: entry points, unknown names, missing client libraries, plugins that break."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

from hicache_storage import (
    BackendSpec,
    MissingDependencyError,
    UnknownBackendError,
    create_backend,
    get_spec,
    hookimpl,
    register_plugin,
    registered_backends,
    registry,
    unregister_plugin,
)


def test_builtins_come_from_entry_points() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="hicache_storage.backends")}
    assert {"file", "memory"} <= names
    assert {"file", "memory"} <= set(registered_backends())
    assert list(registered_backends()) == sorted(registered_backends())


def test_unknown_backend_lists_registered() -> None:
    with pytest.raises(UnknownBackendError, match=r"registered: .*file.*memory"):
        create_backend("nosuch")
    with pytest.raises(LookupError):
        get_spec("nosuch")


class _MissingClientPlugin:
    @hookimpl
    def hicache_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="needs-client",
                factory="hicache_not_installed_client.backend:Backend",
                config="hicache_not_installed_client.backend:Config",
                extra="needs-client",
                requires=("hicache_not_installed_client",),
            )
        ]


def test_missing_client_library_names_the_extra() -> None:
    plugin = _MissingClientPlugin()
    register_plugin(plugin)
    try:
        spec = get_spec("needs-client")
        assert not spec.installed()
        with pytest.raises(
            MissingDependencyError, match=r"pip install 'hicache-storage\[needs-client\]'"
        ):
            create_backend("needs-client")
        with pytest.raises(ImportError):
            create_backend("needs-client")
    finally:
        unregister_plugin(plugin)
    assert "needs-client" not in registered_backends()


BROKEN_DIST = "hicache-test-broken"
BROKEN_VERSION = "1.2.3"


def install_broken_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str = "raise ImportError('needs libfoo')"
) -> None:
    """Install (on ``sys.path``) a distribution whose entry point ``broken-import`` runs ``body``.

    The process-wide registry is swapped for a fresh one, so the entry points are read again.
    """
    module = "hicache_test_broken_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)
    (tmp_path / f"{module}.py").write_text(body + "\n")
    info = tmp_path / f"hicache_test_broken-{BROKEN_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {BROKEN_DIST}\nVersion: {BROKEN_VERSION}\n"
    )
    (info / "entry_points.txt").write_text(
        f"[hicache_storage.backends]\nbroken-import = {module}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", registry._Registry())
    monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("raise ImportError('needs libfoo')", id="import-error"),
        pytest.param("import hicache_no_such_module_anywhere", id="missing-module"),
        pytest.param("raise RuntimeError('needs libfoo')", id="any-exception"),
    ],
)
def test_plugin_failing_to_import_is_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    install_broken_plugin(tmp_path, monkeypatch, body)
    with pytest.warns(registry.PluginLoadWarning, match=r"'broken-import' \(from hicache-test-"):
        backend = create_backend("memory")
    with backend:
        assert backend.set("k", b"v")
    (broken,) = registry.broken_plugins()
    assert broken.name == "broken-import"
    assert broken.origin == registry.Origin(BROKEN_DIST, BROKEN_VERSION)
    assert broken.error.split(":")[0] in ("ImportError", "ModuleNotFoundError", "RuntimeError")
    assert {"file", "memory"} <= set(registered_backends())


def test_unknown_backend_names_the_plugin_that_failed_to_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_broken_plugin(tmp_path, monkeypatch)
    with (
        pytest.warns(registry.PluginLoadWarning),
        pytest.raises(UnknownBackendError, match=r"plugin 'broken-import' failed to load: Import"),
    ):
        get_spec("nosuch")


class _RaisingHookPlugin:
    @hookimpl
    def hicache_backends(self) -> list[BackendSpec]:
        raise RuntimeError("cannot describe my backends")


def test_plugin_whose_hook_raises_is_skipped_with_a_warning() -> None:
    plugin = _RaisingHookPlugin()
    register_plugin(plugin, name="raising-hook")
    try:
        with pytest.warns(registry.PluginLoadWarning, match="raising-hook.*cannot describe"):
            assert "memory" in registered_backends()
        assert [b.name for b in registry.broken_plugins()] == ["raising-hook"]
    finally:
        unregister_plugin(plugin)
    assert registry.broken_plugins() == ()


def test_origin_names_the_distribution_of_the_entry_point() -> None:
    memory = registry.origin_of("memory")
    assert memory is not None and memory.builtin and str(memory) == "built in"
    plugin = _MissingClientPlugin()
    register_plugin(plugin)
    try:
        assert registry.origin_of("needs-client") is None
    finally:
        unregister_plugin(plugin)


def test_origin_of_a_third_party_backend_is_its_distribution() -> None:
    if importlib.util.find_spec("hicache_example_sqlite") is None:
        pytest.fail("the example package is not installed (scripts/test.sh installs it)")
    version = importlib.metadata.version("hicache-example-sqlite")
    origin = registry.origin_of("example-sqlite")
    assert origin == registry.Origin("hicache-example-sqlite", version)
    assert not origin.builtin and str(origin) == f"hicache-example-sqlite {version}"
