"""The S3 backend passes the whole conformance suite against a real SeaweedFS server."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.kit.services import LocalService

from ...helpers import assert_conforms, passing_suite

pytestmark = pytest.mark.timeout(900)
"""A whole suite over a server takes 3-5 minutes on the 2-core CI machine."""


def test_s3_passes_suite_with_server_faults(s3_service: LocalService, tmp_path: Path) -> None:
    config = {**s3_service.options, "prefix": "conformance/"}
    report = passing_suite("s3", config, tmp_path / "report")
    assert report.backend == "s3"
    assert {"persistent", "shared", "delete", "crash_safe_writes"} <= set(report.capabilities)
    assert_conforms(report, server_faults=True)
    ran = {c.id.split("::")[0] for c in report.checks if c.outcome == "passed"}
    assert {"TestMultiProcess", "TestServerFaults", "TestCrashSafety", "TestPersistence"} <= ran
    assert LocalService.load(s3_service.state_file).running(), "the suite left the server down"
