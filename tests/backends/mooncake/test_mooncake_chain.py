"""A local file tier before a real Mooncake master passes the conformance suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.kit.services import LocalService

from ...helpers import assert_conforms, passing_suite


@pytest.mark.timeout(900)
def test_file_before_mooncake_passes_the_suite(
    mooncake_store: LocalService, tmp_path: Path
) -> None:
    remote = {
        "master": mooncake_store.options["master"],
        "global_segment_size": 0,
        "local_hostname": "127.0.0.1",
        "prefix": "chain-conformance/",
    }
    tiers = [
        {"backend": "file", "options": {"root": str(tmp_path / "near")}},
        {"backend": "mooncake", "options": remote},
    ]
    report = passing_suite("chain", {"tiers": tiers}, tmp_path / "report")
    assert {"persistent", "shared", "delete"} <= set(report.capabilities)
    assert_conforms(report)
