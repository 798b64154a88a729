"""Mooncake settings: options over a JSON file over MOONCAKE_* variables over defaults."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from hicache_storage.backends.mooncake.client import Timeouts
from hicache_storage.backends.mooncake.config import MooncakeConfig, parse_bytes
from hicache_storage.config import convert
from hicache_storage.errors import ConfigError


def options(**values: object) -> MooncakeConfig:
    return convert(values, MooncakeConfig, "mooncake backend options")


def test_defaults_match_sglang_but_mount_no_segment() -> None:
    settings = options(master="10.0.0.1:50051").resolve(env={})
    assert settings.master == "10.0.0.1:50051"
    assert settings.metadata_server == "P2PHANDSHAKE"
    assert settings.protocol == "tcp" and settings.device == ""
    assert settings.local_hostname == "localhost"
    # SGLang mounts 4 GiB per rank; objects there die with the process, so by default this
    # backend is a pure client of long-lived segment holders.
    assert settings.global_segment_size == 0
    assert settings.local_buffer_size == 16 << 20
    assert settings.deadline_s == 5.0 and settings.probe_timeout_s == 3.0
    assert settings.prefix == ""


@pytest.mark.parametrize("deadline", [2.0, 3.0, 5.0, 10.0, 60.0, 3600.0])
def test_deadline_shares_fit_the_deadline(deadline: float) -> None:
    timeouts = Timeouts.split(deadline)
    assert isinstance(timeouts.transfer_s, int) and timeouts.transfer_s >= 1
    assert timeouts.rpc_s > 0 and timeouts.cost("meta") <= timeouts.cost("get")
    assert timeouts.cost("put") < deadline  # a put's worst case: 3 RPCs and a transfer
    assert options(master="m:1", deadline_s=deadline).resolve(env={}).deadline_s == deadline


def test_probe_timeout_follows_a_short_deadline() -> None:
    assert options(master="m:1", deadline_s=2).resolve(env={}).probe_timeout_s == 2.0
    assert options(master="m:1", probe_timeout_s=0.5).resolve(env={}).probe_timeout_s == 0.5


@pytest.mark.parametrize(
    ("prefix", "stored"),
    [("", ""), ("ten", "ten"), ("ten/", "ten"), ("ten/sub", "ten/sub"), ("a.b_c-d/e", "a.b_c-d/e")],
)
def test_prefix_is_normalized(prefix: str, stored: str) -> None:
    assert options(master="m:1", prefix=prefix).resolve(env={}).prefix == stored


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
        ({"prefix": "ten:"}, "prefix"),
        ({"prefix": "/ten"}, "prefix"),
        ({"prefix": "ten//sub"}, "prefix"),
        ({"prefix": "ten//"}, "prefix"),
        ({"prefix": "/"}, "prefix"),
        ({"probe_timeout_s": 0}, "probe_timeout_s"),
        ({"probe_timeout_s": float("nan")}, "probe_timeout_s"),
        ({"probe_timeout_s": float("inf")}, "probe_timeout_s"),
        ({"probe_timeout_s": 6.0}, "probe_timeout_s"),  # longer than the deadline
        ({"deadline_s": float("inf")}, "deadline_s"),
        ({"deadline_s": float("nan")}, "deadline_s"),
        ({"deadline_s": 1e300}, "deadline_s"),
        ({"deadline_s": -1}, "deadline_s"),
        ({"deadline_s": 0}, "deadline_s"),
        ({"deadline_s": 1.5}, "deadline_s"),  # below the 2 s minimum
        ({"deadline_s": True}, "deadline_s"),
        ({"global_segment_size": 10**30}, "global_segment_size"),
        ({"global_segment_size": "9" * 400}, "global_segment_size"),
        ({"global_segment_size": "5000TB"}, "global_segment_size"),
        ({"local_buffer_size": "1.5"}, "local_buffer_size"),
        ({"local_hostname": "10.0.0.5:99999"}, "local_hostname"),
        ({"local_hostname": "bad host"}, "local_hostname"),
        ({"metadata_server": "http://meta:99999/metadata"}, "metadata_server"),
        ({"metadata_server": "etcd://a:2379,b:0"}, "metadata_server"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_options_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        options(master="m:1", **values)


@pytest.mark.parametrize("master", ["m:99999", "m:0", "m:-1", "m", "m:1e3", "[::1]:70000"])
def test_bad_master_refused_at_config_time(master: str) -> None:
    with pytest.raises(ConfigError, match="master"):
        options(master=master)


def test_metadata_server_password_is_masked() -> None:
    with pytest.raises(ConfigError) as caught:
        options(master="m:1", metadata_server="http://user:hunter22@meta:99999/metadata")
    assert "hunter22" not in str(caught.value)


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"MOONCAKE_MASTER": "m:99999"}, "master"),
        ({"MOONCAKE_GLOBAL_SEGMENT_SIZE": "99999999TB"}, "global_segment_size"),
        ({"MOONCAKE_LOCAL_HOSTNAME": "h:70000"}, "local_hostname"),
        ({"MOONCAKE_TE_META_DATA_SERVER": "etcd://e:123456"}, "metadata_server"),
    ],
)
def test_bad_values_from_the_environment_refused(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as caught:
        options().resolve(env={"MOONCAKE_MASTER": "m:1", **env})
    assert "$MOONCAKE_" in str(caught.value)  # names where the value came from


@pytest.mark.parametrize("master", ["nohost", "host:port", "host:0", ":50051"])
def test_bad_master_address_refused(master: str) -> None:
    with pytest.raises(ConfigError, match="host:port"):
        options(master=master).resolve(env={})


@pytest.mark.parametrize("master", ["10.0.0.1:50051", "[fe80::1]:50051", "::1:50051", "h_1:1"])
def test_good_master_addresses(master: str) -> None:
    assert options(master=master).resolve(env={}).master_port in (50051, 1)


def test_unreadable_config_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file"):
        options(config_path=str(tmp_path / "absent.json")).resolve(env={})


def test_config_is_a_frozen_struct() -> None:
    config = options(master="m:1")
    with pytest.raises(AttributeError):
        config.master = "other:2"  # type: ignore[misc]
    assert msgspec.to_builtins(config)["master"] == "m:1"
