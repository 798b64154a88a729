"""The registry: entry points, unknown names, missing client libraries."""

from __future__ import annotations

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
