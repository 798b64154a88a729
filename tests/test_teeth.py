"""The conformance suite has teeth: every deliberately broken backend fails the check meant for it.

Each broken backend (``tests/broken_backends``) has exactly one bug. The suite runs against it in
a subprocess that loads ``tests.broken_backends.plugin`` (through ``HICACHE_PLUGINS``, so the
suite's worker processes find it too); the run must fail, and the check the bug declares must be
among the failed or errored rows of its report. The correct backend the file-based bugs start
from must pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_storage.conformance.report import load_report, run_suite
from hicache_storage.registry import PLUGINS_ENV

from .broken_backends import REFERENCE, all_bugs

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
    status = _run(backend, tmp_path, monkeypatch, "-k", check.split("::")[0])
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    print(f"{backend}: {len(failed)} failing checks; {check} says: ", end="")
    print(next((msg for cid, msg in failed.items() if check in cid), "(passed)"))
    assert report.backend == backend
    assert status != 0, f"the suite passed {backend}"
    assert any(check in cid for cid in failed), (
        f"{check} did not catch {backend}; failing checks: {sorted(failed)}"
    )


def _run(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """Run the suite on ``backend`` (a fresh root for file-based ones); return its exit code.

    ``args`` go to pytest: a bug's run keeps to the class of its check (``-k TestX``), which
    keeps the 40-odd runs short; the reference backend runs the whole suite.
    """
    monkeypatch.setenv(
        "PYTHONPATH", str(ROOT)
    )  # the suite's processes import tests.broken_backends
    monkeypatch.setenv(PLUGINS_ENV, "tests.broken_backends.plugin")
    options = {"root": str(tmp_path / "root")} if _needs_root(backend) else None
    extra = ["--timeout", str(CHECK_TIMEOUT_S), *args]
    return run_suite(backend, options, tmp_path / "report", extra)


def _needs_root(backend: str) -> bool:
    found = {bug.spec.name: bug.spec for bug in all_bugs()}.get(backend, REFERENCE)
    return found.config.endswith(":FilePerKeyConfig")


def test_reference_backend_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bugs' starting point is correct: every failure of a bug comes from its bug."""
    status = _run(REFERENCE.name, tmp_path, monkeypatch)
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    assert status == 0 and not failed, f"the reference backend fails: {failed}"
