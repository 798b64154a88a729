"""Mooncake settings: options over a JSON file over MOONCAKE_* variables over defaults."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from hicache_storage.backends.mooncake.config import MooncakeConfig, parse_bytes
from hicache_storage.config import convert
from hicache_storage.errors import ConfigError


def options(**values: object) -> MooncakeConfig:
    return convert(values, MooncakeConfig, "mooncake backend options")


def test_defaults_match_sglang() -> None:
    settings = options(master="10.0.0.1:50051").resolve(env={})
    assert settings.master == "10.0.0.1:50051"
    assert settings.metadata_server == "P2PHANDSHAKE"
    assert settings.protocol == "tcp" and settings.device == ""
    assert settings.local_hostname == "localhost"
    assert settings.global_segment_size == 4 << 30
    assert settings.local_buffer_size == 16 << 20


def test_environment_variables_sglang_users_set() -> None:
    env = {
        "MOONCAKE_MASTER": "m:1",
        "MOONCAKE_PROTOCOL": "rdma",
        "MOONCAKE_DEVICE": "mlx5_0,mlx5_1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "8gb",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "0",
        "MOONCAKE_TE_META_DATA_SERVER": "http://meta:8080/metadata",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.5",
    }
    settings = options().resolve(env=env)
    assert (settings.master_host, settings.master_port) == ("m", 1)
    assert settings.protocol == "rdma" and settings.device == "mlx5_0,mlx5_1"
    assert settings.global_segment_size == 8 << 30 and settings.local_buffer_size == 0
    assert settings.metadata_server == "http://meta:8080/metadata"
    assert settings.local_hostname == "10.0.0.5"


def test_json_file_beats_environment_and_options_beat_both(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {"master_server_address": "file:2", "protocol": "rdma", "global_segment_size": 1024}
        )
    )
    env = {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER": "env:1"}
    from_file = options().resolve(env=env)
    assert from_file.master == "file:2" and from_file.protocol == "rdma"
    assert from_file.global_segment_size == 1024
    explicit = options(master="opt:3", protocol="tcp", config_path=str(path)).resolve(env={})
    assert explicit.master == "opt:3" and explicit.protocol == "tcp"
    assert explicit.global_segment_size == 1024


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4GB", 4 << 30),
        ("512 MiB", 512 << 20),
        ("16mb", 16 << 20),
        ("1k", 1024),
    ],
)
def test_sizes_are_powers_of_1024(text: object, expected: int) -> None:
    assert parse_bytes("size", text) == expected


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"protocol": "udp"}, "protocol"),
        ({"global_segment_size": "lots"}, "global_segment_size"),
        ({"local_buffer_size": -1}, "local_buffer_size"),
        ({"prefix": "bad prefix"}, "prefix"),
        ({"probe_timeout_s": 0}, "probe_timeout_s"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_options_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        options(master="m:1", **values)


@pytest.mark.parametrize("master", ["nohost", "host:port", "host:0", ":50051"])
def test_bad_master_address_refused(master: str) -> None:
    with pytest.raises(ConfigError, match="host:port"):
        options(master=master).resolve(env={})


def test_unreadable_config_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file"):
        options(config_path=str(tmp_path / "absent.json")).resolve(env={})


def test_config_is_a_frozen_struct() -> None:
    config = options(master="m:1")
    with pytest.raises(AttributeError):
        config.master = "other:2"  # type: ignore[misc]
    assert msgspec.to_builtins(config)["master"] == "m:1"
