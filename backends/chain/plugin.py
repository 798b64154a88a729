"""Registers the ``chain`` backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage import BackendSpec, Capabilities, hookimpl

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="chain",
    factory="hicache_storage.backends.chain.backend:ChainBackend",
    config="hicache_storage.backends.chain.config:ChainConfig",
    # An instance claims what its tiers together promise (see chain_capabilities).
    capabilities=Capabilities(),
    baseline="hicache_storage.backends.chain.baseline:first_tier_baseline",
    description="tiers of backends, fastest first (a local disk before a remote store) as one",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the chain backend."""
    return [SPEC]
