"""A suite run has an overall limit: a process that outlives it is killed, never waited for."""

from __future__ import annotations

import time
from pathlib import Path

from hicache_storage.conformance.report import TIMED_OUT, run_suite


def test_a_suite_past_its_limit_is_killed_and_says_so(tmp_path: Path) -> None:
    started = time.monotonic()
    code = run_suite("memory", None, tmp_path / "report", ["-k", "TestRoundTrip"], timeout_s=0.2)
    assert code == TIMED_OUT
    assert time.monotonic() - started < 30  # killed, not waited for (a suite takes seconds)


def test_a_suite_within_its_limit_returns_its_own_exit_code(tmp_path: Path) -> None:
    code = run_suite(
        "memory", None, tmp_path / "report", ["-k", "TestRoundTrip and get_matches"], timeout_s=300
    )
    assert code == 0 and (tmp_path / "report" / "report.json").exists()
