"""Registers the S3 backend; imports nothing but the registry's lightweight records."""

from __future__ import annotations

import urllib.parse
from typing import Any

from hicache_storage.registry import BackendSpec, hookimpl
from hicache_storage.urls import UrlScheme, refuse_extras

from .config import capabilities

__all__ = ["SPEC", "hicache_backends", "hicache_url_schemes"]

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


def _s3_options(url: str) -> dict[str, Any]:
    """``s3://BUCKET[/PREFIX]``: ``bucket`` and, when the path is not empty, ``prefix``."""
    form = "s3://BUCKET[/PREFIX]"
    parts = urllib.parse.urlsplit(url)
    refuse_extras(parts, form)
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ValueError(
            f"{form} takes no user, password or port: credentials come from the AWS chain, and "
            "an S3-compatible store's address is the endpoint_url option (or AWS_ENDPOINT_URL)"
        )
    if not parts.netloc:
        raise ValueError(f"{form} needs a bucket")
    options: dict[str, Any] = {"bucket": parts.netloc}
    prefix = urllib.parse.unquote(parts.path.lstrip("/"))
    if prefix:
        options["prefix"] = prefix
    return options


@hookimpl
def hicache_url_schemes() -> list[UrlScheme]:
    """Claim ``s3://BUCKET[/PREFIX]`` for the s3 backend."""
    return [UrlScheme(scheme="s3", backend="s3", options=_s3_options, example="s3://BUCKET/PREFIX")]
