"""A local file tier before a real S3 gateway (SeaweedFS) passes the conformance suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.kit.services import LocalService

from ...helpers import assert_conforms, passing_suite


@pytest.mark.timeout(900)
def test_file_before_s3_passes_the_suite(s3_service: LocalService, tmp_path: Path) -> None:
    tiers = [
        {"backend": "file", "options": {"root": str(tmp_path / "near")}},
        {"backend": "s3", "options": {**s3_service.options, "prefix": "chain-conformance/"}},
    ]
    report = passing_suite("chain", {"tiers": tiers}, tmp_path / "report")
    assert {"persistent", "shared", "delete", "crash_safe_writes"} <= set(report.capabilities)
    assert_conforms(report)
