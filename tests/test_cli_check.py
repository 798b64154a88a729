"""``hicache check``: the suite's report as a table, with exit status 0 / 1 / 2."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from hicache_storage.cli.check import render
from hicache_storage.conformance.report import CheckResult, Report

from .helpers import FEW_CHECKS


@pytest.fixture
def example_installed() -> None:
    if importlib.util.find_spec("hicache_example_sqlite") is None:
        pytest.fail("the example package is not installed (scripts/test.sh installs it)")


needs_example = pytest.mark.usefixtures("example_installed")


def _hicache(
    *args: str, cwd: Path, tmpdir: Path | None = None, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    # A real process: the suite's own subprocess inherits file descriptors, not CliRunner's streams.
    env = {**os.environ, "COLUMNS": "250", **extra_env}  # wide enough that no check id wraps
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run(
        [sys.executable, "-c", "from hicache_storage.cli import main; main()", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


def _checks_run(stdout: str) -> int:
    """Return the number of checks the summary line counts."""
    counts = re.search(
        r": (\d+) passed, (\d+) failed, (?:(\d+) errored, )?(\d+) skipped in ", stdout
    )
    assert counts, stdout
    return sum(int(n or 0) for n in counts.groups())


def test_check_without_arguments_runs_file_in_a_temp_dir(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = _hicache("check", cwd=tmp_path, tmpdir=scratch)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "PASS file" in result.stdout
    assert "claims: persistent" in result.stdout
    # A summary, not a row per check: the default output is a few lines.
    assert len(result.stdout.splitlines()) < _checks_run(result.stdout) // 4
    assert "TestRoundTrip::test_roundtrip_get_matches_sha256" not in result.stdout
    assert "file backend options" not in result.stderr
    # The file backend's temporary root and the report directory are gone.
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("hicache-")]


@needs_example
def test_check_broken_backend_exits_1(tmp_path: Path) -> None:
    result = _hicache("check", "example-broken", cwd=tmp_path, PYTEST_ADDOPTS=FEW_CHECKS)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL example-broken" in result.stdout
    assert "failed" in result.stdout


FEW = FEW_CHECKS


def test_check_prints_a_summary_and_writes_junit(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    result = _hicache(
        "check", "memory", "--junit-xml", str(junit), cwd=tmp_path, PYTEST_ADDOPTS=FEW
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert re.match(r"PASS memory \S+: \d+ passed, 0 failed, \d+ skipped in [\d.]+ s;", lines[0])
    checks = _checks_run(result.stdout)
    assert len(lines) < checks
    assert "TestRoundTrip::" not in result.stdout and "failed checks" not in result.stdout
    assert "1 check skipped: the backend does not claim persistent" in lines
    assert any(
        line.startswith("8 checks skipped (TestMediumFaults): backend has no medium fault hook")
        for line in lines
    ), result.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    assert len(cases) == int(suite.get("tests", "")) == checks
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "9")
    skipped = [case for case in cases if case.find("skipped") is not None]
    assert len(skipped) == 9 and all(case.find("skipped").get("message") for case in skipped)
    names = {(case.get("classname"), case.get("name")) for case in cases}
    assert ("TestRoundTrip", "test_roundtrip_get_matches_sha256[1B]") in names
    assert all(float(case.get("time", "")) >= 0 for case in cases)


def test_check_verbose_lists_every_check(tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _hicache(
        "check", "memory", "-v", "--report", str(report), cwd=tmp_path, PYTEST_ADDOPTS=FEW
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    checks = json.loads((report / "report.json").read_text())["checks"]
    assert len(checks) == _checks_run(result.stdout)
    for check in checks:
        assert check["id"] in result.stdout
    assert "PASS memory" in result.stdout.splitlines()[-2]  # the summary, then the report's paths


@needs_example
def test_check_broken_backend_lists_its_failures(tmp_path: Path) -> None:
    junit = tmp_path / "out" / "junit.xml"
    junit.parent.mkdir()
    result = _hicache(
        "check",
        "example-broken",
        "--junit-xml",
        str(junit),
        cwd=tmp_path,
        PYTEST_ADDOPTS="-k test_roundtrip_get_matches_sha256",
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.startswith("FAIL example-broken")
    # Values over 64 KiB lose their tail: the three largest sizes fail, the others pass.
    failed = [f"test_roundtrip_get_matches_sha256[{n}B]" for n in (65539, 1048576, 4194304)]
    for name in failed:
        assert f"TestRoundTrip::{name}" in result.stdout
    assert "sha256[4096B]" not in result.stdout
    assert "digest(got) == digest(value)" in result.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("7", "3", "0")
    failures = [case for case in suite.iter("testcase") if case.find("failure") is not None]
    assert [case.get("name") for case in failures] == failed
    assert all("digest" in case.find("failure").get("message", "") for case in failures)


def test_check_junit_file_that_cannot_be_written_exits_2(tmp_path: Path) -> None:
    result = _hicache(
        "check", "memory", "--junit-xml", str(tmp_path / "no" / "j.xml"), cwd=tmp_path
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: --junit-xml ")


def _rendered(report: Report, *, verbose: bool = False) -> list[str]:
    out = io.StringIO()
    render(report, Console(file=out, width=200), verbose=verbose)
    return out.getvalue().splitlines()


def test_default_output_groups_the_skips() -> None:
    unclaimed = "backend does not claim capability {!r}"
    rows = [("passed", None)] * 20 + [
        ("skipped", unclaimed.format("shared")),
        ("skipped", unclaimed.format("shared")),
        ("skipped", unclaimed.format("bounded")),
        ("skipped", "no server control for backend x"),
        ("skipped", "no server control for backend x"),
        ("skipped", "the options under test carry no secret"),
        ("error", None),
    ]
    checks = [
        CheckResult(
            id=f"Test{i % 2}::test_{i}",
            outcome=outcome,  # type: ignore[arg-type]
            skip_reason=reason,
            message="fixture blew up" if outcome == "error" else None,
        )
        for i, (outcome, reason) in enumerate(rows)
    ]
    totals = {o: sum(c.outcome == o for c in checks) for o in ("passed", "failed", "error")}
    totals["skipped"] = 6
    report = Report(backend="x", version="1.0", checks=checks, totals=totals)
    lines = _rendered(report)
    assert lines[0].startswith("FAIL x 1.0: 20 passed, 0 failed, 1 errored, 6 skipped in ")
    assert any("Test0::test_26" in line and "fixture blew up" in line for line in lines)
    assert "2 checks skipped (Test1, Test0): no server control for backend x" in lines
    assert "1 check skipped (Test1::test_25): the options under test carry no secret" in lines
    assert "3 checks skipped: the backend does not claim shared, bounded" in lines
    assert lines[-1] == "--verbose lists all 27 checks."
    assert not any("test_0" in line for line in lines)
    verbose = "\n".join(_rendered(report, verbose=True))
    assert all(check.id in verbose for check in checks)


def test_check_report_dir_gets_json_and_markdown(tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _hicache("check", "memory", "--report", str(report), cwd=tmp_path, PYTEST_ADDOPTS=FEW)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    assert data["backend"] == "memory"
    assert data["totals"]["failed"] == 0 and data["totals"]["passed"] >= 7
    skipped = [c for c in data["checks"] if c["outcome"] == "skipped"]
    assert skipped and all(c["skip_reason"] for c in skipped)
    assert "# Conformance report: `memory`" in (report / "report.md").read_text()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["no-such-backend"], id="unknown-backend"),
        pytest.param(["memory", "--config", '{"bogus": 1}'], id="unknown-option"),
        pytest.param(["memory", "--config", "{not json"], id="bad-json"),
        pytest.param(["file", "--config", "@/nonexistent/config.json"], id="missing-file"),
    ],
)
def test_check_usage_errors_exit_2(tmp_path: Path, args: list[str]) -> None:
    result = _hicache("check", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ")
    assert "Traceback" not in result.stderr


ENGINE_BUG = '''
from hicache_storage import BackendSpec, Capabilities, hookimpl
from hicache_storage.backends.memory.backend import MemoryBackend


class FirstKeyEveryPage(MemoryBackend):
    """A batched page read whose loop never advances: every page gets the first key's bytes."""

    name = "engine-bug"

    def batch_get_v1(self, keys, host_indices):
        return super().batch_get_v1([keys[0]] * len(keys), host_indices)


@hookimpl
def hicache_backends():
    return [
        BackendSpec(
            name="engine-bug",
            factory="engine_bug:FirstKeyEveryPage",
            config="hicache_storage.backends.memory.backend:MemoryConfig",
            capabilities=Capabilities(delete=True),
        )
    ]
'''


def test_check_engine_prints_a_row_per_case_and_writes_json(tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _hicache("check", "memory", "--engine", "-v", "--report", str(report), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "hicache check memory --engine" in result.stdout
    for case in ("write_back/wait_complete", "fresh_engine", "late_pages", "failed_loads"):
        assert case in result.stdout
    assert "PASS memory engine check: 9 passed, 0 failed, 1 skipped" in result.stdout
    data = json.loads((report / "engine.json").read_text())
    assert data["backend"] == "memory"
    fresh = next(c for c in data["checks"] if c["name"] == "fresh_engine")
    assert fresh["outcome"] == "passed" and fresh["stats"]["fresh_storage_hit_tokens"] > 0
    assert (report / "engine.log").exists()


def test_check_engine_backend_serving_wrong_pages_exits_1(tmp_path: Path) -> None:
    (tmp_path / "engine_bug.py").write_text(ENGINE_BUG)
    junit = tmp_path / "junit.xml"
    result = _hicache(
        "check",
        "engine-bug",
        "--engine",
        "--junit-xml",
        str(junit),
        cwd=tmp_path,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        HICACHE_PLUGINS="engine_bug",
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL engine-bug engine check" in result.stdout
    assert "differs from recompute at output token" in result.stdout
    # The JUnit file has every case, classed "engine".
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    assert {case.get("classname") for case in cases} == {"engine"}
    failed = [case.get("name") for case in cases if case.find("failure") is not None]
    assert failed and len(failed) == int(suite.get("failures", "")) < len(cases)


def test_check_engine_unknown_backend_exits_2(tmp_path: Path) -> None:
    result = _hicache("check", "no-such-backend", "--engine", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ")
