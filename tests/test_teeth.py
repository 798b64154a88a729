"""The conformance suite has teeth: every deliberately broken backend fails the check meant for it.

Each broken backend (``tests/broken_backends``) has exactly one bug. The suite runs against it in
a subprocess that loads ``tests.broken_backends.plugin``; the run must fail, and the check named
here must be among the failed or errored rows of its report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.conformance.report import load_report, run_suite

from .broken_backends import all_bugs

ROOT = Path(__file__).resolve().parents[1]

# broken backend -> the check (an id substring from conformance/suite.py) that must catch it
CAUGHT_BY = {found.spec.name: found.caught_by for found in all_bugs()}

# A per-check limit, so broken-hang's 30 s calls fail its checks after a few seconds.
CHECK_TIMEOUT_S = 8


@pytest.mark.parametrize(
    ("backend", "check"),
    [
        pytest.param(name, check, id=f"{name}-caught-by-{check.split('::')[-1]}")
        for name, check in CAUGHT_BY.items()
    ],
)
def test_suite_catches_broken_backend(
    backend: str, check: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the suite's process imports tests.broken_backends
    status = run_suite(
        backend,
        None,
        tmp_path / "report",
        ["-p", "tests.broken_backends.plugin", "--timeout", str(CHECK_TIMEOUT_S)],
    )
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    print(f"{backend}: {len(failed)} failing checks; {check} says: ", end="")
    print(next((msg for cid, msg in failed.items() if check in cid), "(passed)"))
    assert report.backend == backend
    assert status != 0, f"the suite passed {backend}"
    assert any(check in cid for cid in failed), (
        f"{check} did not catch {backend}; failing checks: {sorted(failed)}"
    )
