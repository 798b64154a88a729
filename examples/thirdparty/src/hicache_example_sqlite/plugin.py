"""Registers the example backends; imports nothing but hicache-storage's lightweight records."""

from __future__ import annotations

from hicache_storage import BackendSpec, Capabilities, hookimpl

__all__ = ["BROKEN", "SPEC", "hicache_backends"]

_CAPABILITIES = Capabilities(persistent=True, shared=True, delete=True, crash_safe_writes=True)

SPEC = BackendSpec(
    name="example-sqlite",
    factory="hicache_example_sqlite.backend:SqliteBackend",
    config="hicache_example_sqlite.backend:SqliteConfig",
    distribution="hicache-example-sqlite",
    requires=("sqlite3",),
    capabilities=_CAPABILITIES,
    description="one SQLite table (third-party example)",
)

BROKEN = BackendSpec(
    name="example-broken",
    factory="hicache_example_sqlite.backend:TruncatingSqliteBackend",
    config="hicache_example_sqlite.backend:SqliteConfig",
    distribution="hicache-example-sqlite",
    requires=("sqlite3",),
    capabilities=_CAPABILITIES,
    description="example-sqlite with a bug: truncates values over 64 KiB (fails conformance)",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the example backend and its deliberately broken twin."""
    return [SPEC, BROKEN]
