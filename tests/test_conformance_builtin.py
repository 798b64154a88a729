"""The built-in backends pass the conformance suite, skipping exactly what they do not claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.conformance.report import load_report, run_suite

from .helpers import assert_conforms


@pytest.mark.parametrize(
    ("name", "options", "claims_bounded"),
    [
        ("memory", None, False),
        ("file", {}, False),
        ("file", {"max_bytes": 16 << 20}, True),
        ("file", {"naming": "sglang_file_compat"}, False),
    ],
    ids=["memory", "file", "file-bounded", "file-sglang-compat"],
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
    bare = (options or {}).get("naming") == "sglang_file_compat"  # no integrity record
    assert_conforms(report, integrity=name == "file" and not bare, medium_faults=name == "file")
    skipped = {c.id for c in report.checks if c.outcome == "skipped"}
    bounded = {c.id for c in report.checks if "bounded" in c.requires}
    assert bounded and (bounded <= skipped) is not claims_bounded
