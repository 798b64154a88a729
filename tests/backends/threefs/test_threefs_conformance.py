"""The 3FS backend passes the conformance suite with both kinds of metadata.

In process: the files belong to one instance, so the shared/persistent checks are skipped as
unclaimed, and there is no server whose faults to check. With the metadata service: every
check runs, the multi-process ones through the one service, and the server-fault checks stop
and restart it.
"""

from __future__ import annotations

from pathlib import Path

from hicache_storage.kit.services import LocalService

from ...helpers import assert_conforms, passing_suite
from .conftest import GEOMETRY, service_options


def test_suite_passes_with_in_process_metadata(tmp_path: Path) -> None:
    config = {"path": str(tmp_path / "store"), **GEOMETRY}
    report = passing_suite("3fs", config, tmp_path / "report")
    assert_conforms(report, integrity=True, medium_faults=True)
    assert {"native_zero_copy", "bounded", "delete"} <= set(report.capabilities)
    assert not {"shared", "persistent", "crash_safe_writes"} & set(report.capabilities)


def test_suite_passes_with_metadata_service(tmp_path: Path, shared_service: LocalService) -> None:
    config = service_options(shared_service, tmp_path / "store")
    report = passing_suite("3fs", config, tmp_path / "report")
    assert_conforms(report, server_faults=True, integrity=True, medium_faults=True)
    claimed = set(report.capabilities)
    assert {"shared", "persistent", "crash_safe_writes", "native_zero_copy"} <= claimed
    ran = {c.id for c in report.checks if c.outcome == "passed"}
    assert any(c.startswith("TestMultiProcess::") for c in ran)
    assert any(c.startswith("TestCrashSafety::") for c in ran)


def test_store_smaller_than_a_batch_passes_the_batch_checks(
    tmp_path: Path, shared_service: LocalService
) -> None:
    """128 slots of 4 MiB (issue 14, item 16): the long-batch check keeps to the declared bound."""
    config = {
        **service_options(shared_service, tmp_path / "store"),
        "file_prefix": "small",
        "file_size": 256 << 20,
        "file_count": 2,
        "slot_bytes": 4 << 20,
    }
    report = passing_suite("3fs", config, tmp_path / "report", ["-k", "TestBatch"])
    assert "TestBatch::test_batch_long_300_keys" in {
        c.id for c in report.checks if c.outcome == "passed"
    }


def test_small_store_runs_the_bounded_checks(tmp_path: Path, shared_service: LocalService) -> None:
    """A 16 MiB store: eviction accounting and reads racing evictions run (the default bound of
    64 GiB is too large for the suite to overfill, so those checks skip there)."""
    config = {
        **service_options(shared_service, tmp_path / "store"),
        "file_prefix": "bounded",
        "file_size": 8 << 20,
        "file_count": 2,
        "slot_bytes": 64 << 10,
    }
    report = passing_suite("3fs", config, tmp_path / "report", ["-k", "TestBounded"])
    passed = {c.id for c in report.checks if c.outcome == "passed"}
    assert {
        "TestBounded::test_stats_report_usage_bound_and_evictions",
        "TestBounded::test_readers_racing_eviction_none_or_whole",
    } <= passed, sorted(passed)
