"""``hicache doctor``: each trap of a deployment is named, with its numbers and its fix."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hicache_storage.backends.memory.config import capabilities
from hicache_storage.cli.main import main
from hicache_storage.doctor import Finding, ServingPlan, diagnose
from hicache_storage.registry import BackendSpec, hookimpl, register_plugin, unregister_plugin

SMALL = ServingPlan(bytes_per_token=1024, prefetch_tokens=512, repeats=1)
"""64 KiB pages, a prefix of 8: fast on any store."""


def _by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


@pytest.mark.parametrize(
    ("host", "status", "says"),
    [
        (16_384, "fail", "not larger than the device pool"),
        (8_000, "fail", "not larger than the device pool"),
        (24_576, "warn", "under 50% full"),
        (32_768, "warn", "under 50% full"),
        (40_000, "ok", "2.4x the device pool"),
    ],
)
def test_the_host_pool_must_leave_prefetches_room(host: int, status: str, says: str) -> None:
    plan = dataclasses.replace(SMALL, device_tokens=16_384, host_tokens=host)
    found = _by_check(diagnose("memory", None, plan))["host pool"]
    assert (found.status, says in found.detail) == (status, True), found
    assert bool(found.fix) is (status != "ok")


def test_pool_sizes_not_given_skip_the_host_pool_check() -> None:
    assert _by_check(diagnose("memory", None, SMALL))["host pool"].status == "skip"


def test_a_file_store_passes_every_check_and_keeps_nothing(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    plan = dataclasses.replace(SMALL, device_tokens=1024, host_tokens=4096)
    found = _by_check(diagnose("file", {"root": str(root)}, plan))
    assert {f.check: f.status for f in found.values()} == {
        "host pool": "ok",
        "client library": "ok",
        "reachable": "ok",
        "round trip": "ok",
        "read back by another client": "ok",
        "prefetch time": "ok",
        "capacity": "ok",
        "disk space": "ok",
    }
    assert "8 pages" in found["prefetch time"].detail
    assert "no max_bytes" in found["disk space"].detail
    assert not [p for p in root.rglob("*") if p.is_file() and "doctor" in p.name]


def test_memory_pages_are_never_read_by_another_process() -> None:
    found = _by_check(diagnose("memory", None, SMALL))["read back by another client"]
    assert found.status == "warn" and "this process only" in found.detail


class _PrivateButClaimsShared:
    """A dictionary per client that claims ``shared``: a second client finds nothing."""

    @hookimpl
    def hicache_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="doctor-private",
                factory="hicache_storage.backends.memory.backend:MemoryBackend",
                config="hicache_storage.backends.memory.config:MemoryConfig",
                capabilities=dataclasses.replace(capabilities(), shared=True),
            ),
            BackendSpec(
                name="doctor-no-client",
                factory="hicache_doctor_absent.backend:Backend",
                config="hicache_doctor_absent.backend:Config",
                extra="doctor-absent",
                requires=("hicache_doctor_absent",),
            ),
        ]


@pytest.fixture
def doctor_plugin() -> Iterator[None]:
    plugin = _PrivateButClaimsShared()
    register_plugin(plugin, name="test-doctor")
    try:
        yield
    finally:
        unregister_plugin(plugin)


@pytest.mark.usefixtures("doctor_plugin")
def test_writes_a_second_client_cannot_read_fail() -> None:
    found = _by_check(diagnose("doctor-private", None, SMALL))["read back by another client"]
    assert found.status == "fail"
    assert "never read back" in found.detail and "namespace" in found.fix


@pytest.mark.usefixtures("doctor_plugin")
def test_a_missing_client_library_names_the_extra_and_stops_there() -> None:
    findings = diagnose("doctor-no-client", None, SMALL)
    found = _by_check(findings)
    assert found["client library"].status == "fail"
    assert "hicache_doctor_absent" in found["client library"].detail
    assert found["client library"].fix == "pip install 'hicache-storage[doctor-absent]'"
    assert "reachable" not in found


def test_a_prefetch_slower_than_its_timeout_fails() -> None:
    plan = dataclasses.replace(SMALL, timeout_base_s=0.0, timeout_per_ki_token_s=0.0)
    found = _by_check(diagnose("memory", None, plan))["prefetch time"]
    assert found.status == "fail"
    assert "512-token prefix (8 pages, 512.0 KiB)" in found.detail
    assert "stops it after 0.000 s" in found.detail


def test_best_effort_prefetches_are_named() -> None:
    plan = dataclasses.replace(SMALL, prefetch_policy="best_effort")
    found = _by_check(diagnose("memory", None, plan))["prefetch time"]
    assert found.status == "warn" and found.fix == "--hicache-storage-prefetch-policy timeout"


def test_a_store_bound_beyond_the_free_disk_is_named(tmp_path: Path) -> None:
    options = {"root": str(tmp_path / "kv"), "max_bytes": 1 << 55}
    found = _by_check(diagnose("file", options, SMALL))["disk space"]
    assert found.status == "warn" and "less than the store's max_bytes" in found.detail


def test_a_store_bound_smaller_than_the_host_pool_is_named(tmp_path: Path) -> None:
    plan = dataclasses.replace(SMALL, device_tokens=1024, host_tokens=4096)  # a 4 MiB host pool
    small = {"root": str(tmp_path / "small"), "max_bytes": 1 << 20}
    found = _by_check(diagnose("file", small, plan))["capacity"]
    assert found.status == "warn" and "holds less than one host pool (4.0 MiB)" in found.detail
    roomy = {"root": str(tmp_path / "roomy"), "max_bytes": 64 << 20}
    found = _by_check(diagnose("file", roomy, plan))["capacity"]
    assert found.status == "ok" and "of 64.0 MiB" in found.detail and "policy lru" in found.detail


def test_an_unreachable_server_fails_within_its_deadline_and_exits_1() -> None:
    result = CliRunner().invoke(
        main,
        ["doctor", "redis://127.0.0.1:1/0", "--config", '{"deadline_s": 1.0}', "--json"],
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    found = {row["check"]: row for row in report["findings"]}
    assert report["ok"] is False and report["backend"] == "redis"
    assert found["reachable"]["status"] == "fail"
    assert "BackendUnavailableError" in found["reachable"]["detail"]
    assert "round trip" not in found


def test_missing_options_are_named_as_options_not_as_an_unreachable_server() -> None:
    result = CliRunner().invoke(main, ["doctor", "file", "--json"])
    assert result.exit_code == 1, result.output
    found = {row["check"]: row for row in json.loads(result.output)["findings"]}
    assert "ConfigError" in found["reachable"]["detail"] and "root" in found["reachable"]["detail"]
    assert "--config" in found["reachable"]["fix"] and "server" not in found["reachable"]["fix"]


def test_the_command_prints_a_row_per_check_and_exits_0(tmp_path: Path) -> None:
    config = json.dumps({"root": str(tmp_path / "kv")})
    result = CliRunner().invoke(
        main,
        ["doctor", "file", "--config", config, "--device-tokens", "1000", "--host-ratio", "3"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    for check in ("host pool", "reachable", "round trip", "prefetch time", "disk space"):
        assert check in result.output
    assert result.output.rstrip().endswith("file: no check failed")


@pytest.mark.parametrize(
    "args",
    [["--host-ratio", "2"], ["--device-tokens", "10", "--host-ratio", "2", "--host-tokens", "5"]],
)
def test_inconsistent_pool_flags_are_a_usage_error(args: list[str]) -> None:
    result = CliRunner().invoke(main, ["doctor", "memory", *args])
    assert result.exit_code == 2, result.output
