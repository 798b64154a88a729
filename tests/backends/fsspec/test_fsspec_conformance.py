"""The fsspec backend passes the whole conformance suite on file://, memory:// and s3://."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ...helpers import assert_conforms, passing_suite

pytestmark = pytest.mark.timeout(900)
"""A whole suite over a server takes 3-5 minutes on the 2-core CI machine."""


def _passes(config: dict[str, Any], report_dir: Path, claims: set[str]) -> None:
    report = passing_suite("fsspec", config, report_dir)
    assert report.backend == "fsspec"
    assert set(report.capabilities) == claims
    assert_conforms(report, medium_faults=True)


def test_file_url_passes_suite(tmp_path: Path) -> None:
    claims = {
        "persistent",
        "shared",
        "native_zero_copy",
        "delete",
        "crash_safe_writes",
        "atomic_first_wins",
    }
    _passes({"url": f"file://{tmp_path / 'store'}"}, tmp_path / "report", claims)


def test_memory_url_passes_suite(tmp_path: Path) -> None:
    _passes({"url": "memory://conformance"}, tmp_path / "report", {"delete", "atomic_first_wins"})


def test_s3_url_passes_suite(s3_url_options: dict[str, Any], tmp_path: Path) -> None:
    claims = {"persistent", "shared", "delete", "crash_safe_writes", "atomic_first_wins"}
    _passes(s3_url_options, tmp_path / "report", claims)
