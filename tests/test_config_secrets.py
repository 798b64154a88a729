"""No config's ``repr`` or ``str`` shows a secret it holds (issue 48, item 11).

A config lands in log lines and in tracebacks that print locals; every config record that can hold
a password, a token, a secret key or a URL with a password masks it, as ``RedisConfig`` does.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from msgspec import inspect

from hicache_storage.backends.mooncake.config import MooncakeConfig
from hicache_storage.bench.engine import BenchConfig
from hicache_storage.config import convert, load_config
from hicache_storage.integrations.vllm.config import tier_settings
from hicache_storage.redact import MASK, is_secret_name, redacted_repr
from hicache_storage.registry import registered_backends

from .helpers import builtin_backends

REDIS_URL = "redis://user:redis-url-pass-1@127.0.0.1:6379/0"
S3_SECRET = "s3-secret-access-key-2"

SECRET_OPTIONS: dict[str, list[tuple[dict[str, Any], list[str]]]] = {
    "3fs": [
        (
            {
                "path": "/tmp/hicache-secrets-3fs",
                "metadata_url": "http://meta:meta-url-pass-3@127.0.0.1:18000",
                "metadata_token": "threefs-token-4",
            },
            ["meta-url-pass-3", "threefs-token-4"],
        )
    ],
    "file": [({"root": "/tmp/hicache-secrets-file"}, [])],  # holds no secret
    "fsspec": [
        (
            {
                "url": "s3://user:fsspec-url-pass-5@bucket/prefix",
                "storage_options": {"secret": S3_SECRET, "client_kwargs": {"token": "tok-6xx"}},
            },
            ["fsspec-url-pass-5", S3_SECRET, "tok-6xx"],
        )
    ],
    "memory": [({}, [])],  # holds no secret
    "mooncake": [
        (
            {
                "master": "127.0.0.1:50051",
                "metadata_server": "http://user:mooncake-meta-pass-7@127.0.0.1:8080/metadata",
            },
            ["mooncake-meta-pass-7"],
        ),
        (
            {"master": "127.0.0.1:50051", "metadata_server": "etcd://u:etcd-pass-8@h:2379"},
            ["etcd-pass-8"],
        ),
    ],
    "process": [
        ({"backend": "redis", "options": {"url": REDIS_URL}}, ["redis-url-pass-1"]),
        (
            {"backend": "redis", "options": {"url": "redis://h:1/0", "password": "redis-pw-9"}},
            ["redis-pw-9"],
        ),
        (
            {
                "backend": "fsspec",
                "options": {"url": "s3://b/p", "storage_options": {"secret": S3_SECRET}},
            },
            [S3_SECRET],
        ),
    ],
    "chain": [
        (
            {
                "tiers": [
                    {"backend": "memory"},
                    {"backend": "redis", "options": {"url": REDIS_URL}},
                    {"backend": REDIS_URL},
                    {"backend": "redis", "options": {"url": "redis://h:1/0", "password": "pw-11"}},
                ]
            },
            ["redis-url-pass-1", "pw-11"],
        ),
    ],
    "redis": [
        ({"url": REDIS_URL, "password": "redis-pw-10"}, ["redis-url-pass-1", "redis-pw-10"]),
    ],
    "s3": [({"bucket": "hicache-secrets"}, [])],  # credentials come from the AWS chain only
}
"""Per built-in backend, options holding every kind of secret its config accepts."""


def _shown(record: object) -> str:
    return repr(record) + "\n" + str(record)


def _assert_masked(record: object, secrets: list[str]) -> None:
    shown = _shown(record)
    for secret in secrets:
        assert secret not in shown, f"{secret!r} shown by {type(record).__name__}: {shown}"
    if secrets:
        assert MASK in shown


def test_the_built_in_backends_are_found() -> None:
    assert {"file", "memory", "redis", "s3"} <= set(builtin_backends())


@pytest.mark.parametrize("name", builtin_backends())
def test_every_backend_config_masks_its_secrets(name: str) -> None:
    assert name in SECRET_OPTIONS, f"add options with every secret {name!r} accepts"
    schema = registered_backends()[name].load_config_type()
    secret_fields = {
        field.name
        for field in inspect.type_info(schema).fields  # type: ignore[union-attr]
        if is_secret_name(field.name)
    }
    covered = {key for options, _ in SECRET_OPTIONS[name] for key in options}
    assert secret_fields <= covered, f"{name}: set {sorted(secret_fields - covered)} too"
    for options, secrets in SECRET_OPTIONS[name]:
        _assert_masked(convert(options, schema, f"{name} backend options"), secrets)


def test_mooncake_resolved_settings_mask_the_metadata_password() -> None:
    config = MooncakeConfig(
        master="127.0.0.1:50051",
        metadata_server="http://user:mooncake-meta-pass-7@127.0.0.1:8080/metadata",
    )
    _assert_masked(config.resolve({}), ["mooncake-meta-pass-7"])


def _whole(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    return {"backend": backend, "options": options}


INTEGRATION_SECRETS = [
    (options, secrets)
    for name, examples in SECRET_OPTIONS.items()
    for options, secrets in examples
    if secrets
    for options in [_whole(name, options)]
]


@pytest.mark.parametrize(("data", "secrets"), INTEGRATION_SECRETS)
def test_whole_configs_mask_their_backends_secrets(
    data: dict[str, Any], secrets: list[str]
) -> None:
    _assert_masked(load_config(data, env={}), secrets)


@pytest.mark.parametrize(("data", "secrets"), INTEGRATION_SECRETS)
def test_vllm_tier_settings_mask_their_backends_secrets(
    data: dict[str, Any], secrets: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("HICACHE_")]:
        monkeypatch.delenv(name)
    _assert_masked(tier_settings(data), secrets)
    _assert_masked(tier_settings({"config": data}), secrets)


@pytest.mark.parametrize(("data", "secrets"), INTEGRATION_SECRETS)
def test_engine_bench_config_masks_its_backends_secrets(
    data: dict[str, Any], secrets: list[str]
) -> None:
    _assert_masked(BenchConfig(backend=data["backend"], backend_config=data["options"]), secrets)


class _Record(msgspec.Struct):
    name: str
    api_key: str | None = None
    urls: tuple[str, ...] = ()
    nested: dict[str, Any] = {}


def test_redacted_repr_keeps_the_shape_of_what_it_masks() -> None:
    record = _Record(
        "n", api_key="k" * 8, urls=("redis://:pw-11@h",), nested={"password": "p" * 8, "n": 1}
    )
    assert redacted_repr(record) == (
        "_Record(name='n', api_key='***', urls=('redis://:***@h',), "
        "nested={'password': '***', 'n': 1})"
    )
    assert redacted_repr(_Record("n")) == "_Record(name='n', api_key=None, urls=(), nested={})"
