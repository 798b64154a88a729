"""``hicache check``: the suite's report as a table, with exit status 0 / 1 / 2."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


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


def test_check_without_arguments_runs_file_in_a_temp_dir(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = _hicache("check", cwd=tmp_path, tmpdir=scratch)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "hicache check file" in result.stdout
    assert "TestRoundTrip::test_roundtrip_get_matches_sha256" in result.stdout
    assert "PASS file" in result.stdout
    assert "claims: persistent" in result.stdout
    assert "file backend options" not in result.stderr
    # The file backend's temporary root and the report directory are gone.
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("hicache-")]


@needs_example
def test_check_broken_backend_exits_1(tmp_path: Path) -> None:
    result = _hicache("check", "example-broken", cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL example-broken" in result.stdout
    assert "failed" in result.stdout


def test_check_report_dir_gets_json_and_markdown(tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = _hicache("check", "memory", "--report", str(report), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    assert data["backend"] == "memory"
    assert data["totals"]["failed"] == 0 and data["totals"]["passed"] > 100
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
    result = _hicache("check", "memory", "--engine", "--report", str(report), cwd=tmp_path)
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
    result = _hicache(
        "check",
        "engine-bug",
        "--engine",
        cwd=tmp_path,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        HICACHE_PLUGINS="engine_bug",
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL engine-bug engine check" in result.stdout
    assert "differs from recompute at output token" in result.stdout


def test_check_engine_unknown_backend_exits_2(tmp_path: Path) -> None:
    result = _hicache("check", "no-such-backend", "--engine", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ")
