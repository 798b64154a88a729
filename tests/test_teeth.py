"""The conformance suite has teeth: every deliberately broken backend fails the check meant for it.

Each broken backend (``tests/broken_backends``) has exactly one bug. The suite runs against it in
a subprocess that loads ``tests.broken_backends.plugin`` (through ``HICACHE_PLUGINS``, so the
suite's worker processes find it too); the run must fail, and the check the bug declares must be
among the failed or errored rows of its report. The correct backend the file-based bugs start
from must pass.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hicache_storage.conformance.report import Report, load_report, run_suite
from hicache_storage.registry import PLUGINS_ENV

from .broken_backends import REFERENCE, all_bugs

ROOT = Path(__file__).resolve().parents[1]

# broken backend -> the check (an id substring from conformance/suite.py) that must catch it
CAUGHT_BY = {found.spec.name: found.caught_by for found in all_bugs()}

# A per-check limit, so broken-hang's 30 s calls fail its checks after a few seconds.
CHECK_TIMEOUT_S = 8
# The reference backend's whole-suite run: its multi-process checks start interpreters, which
# take longer than 8 s on a loaded 2-core machine; nothing in it hangs.
REFERENCE_CHECK_TIMEOUT_S = 60
# A whole run's limit: a broken backend that leaks threads can hold its finished suite at exit.
SUITE_TIMEOUT_S = 600

pytestmark = pytest.mark.timeout(1200)
"""The ``reports`` fixture runs every broken backend's suite before the first test (about 60
runs, two at a time): far more than the default per-test limit, which its own runs still keep.
``scripts/test.sh`` hands a file to one worker (``--dist loadfile``), so those runs happen once."""

RUNS_AT_ONCE = 2
"""Suite processes run side by side (one per core of the CI machine): each bug's run is mostly
process start-up, and the race checks are built to catch their bugs under this load."""


@pytest.fixture(scope="module")
def reports(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, tuple[int, Report]]:
    """Run the suite on every selected broken backend, ``RUNS_AT_ONCE`` at a time.

    Only the backends of the tests this session runs (``-k broken-racy-pool`` runs one); the
    exit code and the report of each.
    """
    root = tmp_path_factory.mktemp("teeth")
    selected = {
        item.callspec.params["backend"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and hasattr(item, "callspec")
        and "backend" in item.callspec.params
    }
    with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(RUNS_AT_ONCE) as pool:
        _plugin_env(env)
        runs = {
            name: pool.submit(_run, name, root / name, "-k", _selector(check))
            for name, check in CAUGHT_BY.items()
            if name in selected
        }
        codes = {name: run.result() for name, run in runs.items()}
    return {name: (code, load_report(root / name / "report")) for name, code in codes.items()}


@pytest.mark.parametrize(
    ("backend", "check"),
    [
        pytest.param(name, check, id=f"{name}-caught-by-{check.split('::')[-1]}")
        for name, check in CAUGHT_BY.items()
    ],
)
def test_suite_catches_broken_backend(
    backend: str, check: str, reports: dict[str, tuple[int, Report]]
) -> None:
    status, report = reports[backend]
    failed = {row.id: row.message for row in report.failures()}
    print(f"{backend}: {len(failed)} failing checks; {check} says: ", end="")
    print(next((msg for cid, msg in failed.items() if check in cid), "(passed)"))
    assert report.backend == backend
    assert status != 0, f"the suite passed {backend}"
    assert any(check in cid for cid in failed), (
        f"{check} did not catch {backend}; failing checks: {sorted(failed)}"
    )


def test_reference_backend_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bugs' starting point is correct: every failure of a bug comes from its bug."""
    _plugin_env(monkeypatch)
    status = _run(REFERENCE.name, tmp_path, check_timeout_s=REFERENCE_CHECK_TIMEOUT_S)
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    assert status == 0 and not failed, f"the reference backend fails: {failed}"


def _plugin_env(env: pytest.MonkeyPatch) -> None:
    """Make the suite's processes (and their workers) load the broken backends' plugin."""
    env.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setenv(PLUGINS_ENV, "tests.broken_backends.plugin")


def _run(backend: str, workdir: Path, *args: str, check_timeout_s: int = CHECK_TIMEOUT_S) -> int:
    """Run the suite on ``backend`` (a fresh root for file-based ones); return its exit code.

    ``args`` go to pytest: a bug's run keeps to its check (``-k "TestX and test_y"``), which
    keeps the 40-odd runs short; the reference backend runs the whole suite.
    """
    options = {"root": str(workdir / "root")} if _needs_root(backend) else None
    extra = ["--timeout", str(check_timeout_s), *args]
    return run_suite(backend, options, workdir / "report", extra, timeout_s=SUITE_TIMEOUT_S)


def _selector(check: str) -> str:
    """Return the ``-k`` expression that selects ``check`` (all its parameters)."""
    cls, _, name = check.partition("::")
    return f"{cls} and {name.split('[')[0]}" if name else cls


def _needs_root(backend: str) -> bool:
    found = {bug.spec.name: bug.spec for bug in all_bugs()}.get(backend, REFERENCE)
    return found.config.endswith(":FilePerKeyConfig")
