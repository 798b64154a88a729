"""The third-party example package (examples/thirdparty) passes the suite both ways in.

``scripts/test.sh`` installs it (``pip install -e examples/thirdparty``), so its entry point
registers ``example-sqlite`` and ``example-broken``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "thirdparty"


@pytest.fixture(autouse=True)
def _example_installed() -> None:
    if importlib.util.find_spec("hicache_example_sqlite") is None:
        pytest.fail(
            "the example package is not installed: "
            "pip install -e examples/thirdparty --no-deps (scripts/test.sh does)"
        )


def _pytest(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_importable_suite_passes(tmp_path: Path) -> None:
    # The way in is under test, not the backend: the entry-point test below runs every check.
    args = [str(EXAMPLE / "tests"), "--basetemp", str(tmp_path / "tmp"), "-k", "TestRoundTrip"]
    result = _pytest(args, tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_plugin_suite_passes_against_entry_point(tmp_path: Path) -> None:
    config = json.dumps({"path": str(tmp_path / "kv.sqlite3")})
    report = tmp_path / "report"
    result = _pytest(
        [
            "--hicache-backend",
            "example-sqlite",
            "--hicache-config",
            config,
            "--hicache-report",
            str(report),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    assert data["backend"] == "example-sqlite"
    assert data["version"] == "0.2.0"  # the example distribution's version, not hicache-storage's
    assert "persistent" in data["capabilities"]
    assert data["totals"]["passed"] > 100 and data["totals"]["failed"] == 0
