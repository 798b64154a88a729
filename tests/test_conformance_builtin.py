"""The built-in backends pass the conformance suite, skipping exactly what they do not claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache_storage.conformance.report import Report, load_report, run_suite

CAPABILITY_SKIP = re.compile(r"backend does not claim capability '(\w+)'")


def assert_conforms(report: Report) -> None:
    assert report.totals["failed"] == 0 and report.totals["error"] == 0, report.failures()
    assert report.totals["total"] == len(report.checks) > 100
    claimed = set(report.capabilities)
    for check in report.checks:
        unclaimed = [name for name in check.requires if name not in claimed]
        if check.outcome == "skipped":
            reason = check.skip_reason or ""
            match = CAPABILITY_SKIP.fullmatch(reason)
            if match:
                assert match.group(1) in unclaimed, (check.id, reason)
            else:
                assert check.id.startswith("TestServerFaults::"), (check.id, reason)
                assert reason == (
                    f"no server control for backend {report.backend} "
                    "(provide the hicache_conformance_server hook)"
                )
        else:
            assert check.outcome == "passed", check
            assert not unclaimed, f"{check.id} ran although {unclaimed} is not claimed"


@pytest.mark.parametrize(
    ("name", "options", "claims_bounded"),
    [
        ("memory", None, False),
        ("file", {}, False),
        ("file", {"max_bytes": 16 << 20}, True),
    ],
    ids=["memory", "file", "file-bounded"],
)
def test_builtin_backend_passes_suite(
    tmp_path: Path, name: str, options: dict[str, object] | None, claims_bounded: bool
) -> None:
    config = None if options is None else {"root": str(tmp_path / "store"), **options}
    report_dir = tmp_path / "report"
    assert run_suite(name, config, report_dir) == 0
    report = load_report(report_dir)
    assert report.backend == name and report.version
    assert ("bounded" in report.capabilities) is claims_bounded
    assert (report_dir / "report.md").read_text().startswith(f"# Conformance report: `{name}`")
    assert_conforms(report)
    skipped = {c.id for c in report.checks if c.outcome == "skipped"}
    bounded = {c.id for c in report.checks if "bounded" in c.requires}
    assert bounded and (bounded <= skipped) is not claims_bounded
