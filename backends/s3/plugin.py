"""Registers the S3 backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

from hicache_storage.registry import BackendSpec, hookimpl

from .config import capabilities

__all__ = ["SPEC", "hicache_backends"]

SPEC = BackendSpec(
    name="s3",
    factory="hicache_storage.backends.s3.backend:S3Backend",
    config="hicache_storage.backends.s3.config:S3Config",
    extra="s3",
    requires=("boto3", "botocore"),
    capabilities=capabilities(),
    baseline="hicache_storage.backends.s3.baseline:RawBoto3Baseline",
    description="one object per key in an S3 (or S3-compatible) bucket, under a prefix",
    namespace_option="prefix",
)


@hookimpl
def hicache_backends() -> list[BackendSpec]:
    """Provide the S3 backend."""
    return [SPEC]
