"""The CLI's outputs: checked before the run, no finished result lost, reports kept private."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hicache_storage.bench.engine import BenchConfig, BenchResult, run_bench
from hicache_storage.cli import engine as engine_cli
from hicache_storage.cli import main
from hicache_storage.conformance import engine as engine_check
from hicache_storage.conformance import report as conformance_report
from hicache_storage.conformance.engine import EngineCheck, EngineReport
from hicache_storage.conformance.report import Report, write_report

TINY = BenchConfig().with_settings(
    {
        "workload": {
            "clients": 1,
            "rounds": 1,
            "system_tokens": 4,
            "turn_tokens": (2, 4),
            "max_new_tokens": 1,
            "concurrency": 1,
        },
        "engine": {"device_tokens": 16, "host_tokens": 32, "chunk_tokens": 16},
        "page_size": 4,
    }
)


@pytest.fixture(scope="module")
def tiny_result() -> BenchResult:
    """One real run of the tiniest benchmark, which every CLI test below is handed."""
    return run_bench(TINY)


@pytest.fixture
def bench(tiny_result: BenchResult, monkeypatch: pytest.MonkeyPatch) -> list[BenchConfig]:
    """Make ``hicache engine bench`` answer ``tiny_result``; return the configs it ran."""
    ran: list[BenchConfig] = []

    def fake(config: BenchConfig, **kwargs: Any) -> BenchResult:
        ran.append(config)
        return tiny_result

    monkeypatch.setattr(engine_cli, "run_bench", fake)
    return ran


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"})


def one_error_line(result: Result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert line.startswith("error: ")
    return line


# -- hicache engine bench -----------------------------------------------------------------------


def test_an_unwritable_json_path_is_refused_before_the_run(
    tmp_path: Path, bench: list[BenchConfig]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path in (blocker / "out.json", tmp_path / "no-dir" / "out.json", tmp_path):
        line = one_error_line(invoke("engine", "bench", "--json", str(path)))
        assert f"--json {str(path)!r}: cannot write there" in line
    assert bench == []


def test_an_unwritable_plot_path_is_refused_before_the_run(
    tmp_path: Path, bench: list[BenchConfig]
) -> None:
    pytest.importorskip("matplotlib")
    line = one_error_line(invoke("engine", "bench", "--plot", str(tmp_path / "no" / "ttft.png")))
    assert "--plot" in line and "cannot write there" in line
    line = one_error_line(invoke("engine", "bench", "--plot", str(tmp_path / "ttft.xyz")))
    assert "cannot write .xyz files" in line
    assert bench == [] and not (tmp_path / "ttft.xyz").exists()


def test_the_up_front_check_leaves_no_file_behind(tmp_path: Path, bench: list[BenchConfig]) -> None:
    target = tmp_path / "out.json"
    result = invoke("engine", "bench", "--json", str(target), "--device", "mps")
    one_error_line(result)
    assert not target.exists()


@pytest.mark.parametrize("device", ["mps", "meta", "xpu", "mps:0"])
def test_a_device_the_engine_cannot_run_on_is_one_line(
    device: str, bench: list[BenchConfig]
) -> None:
    line = one_error_line(invoke("engine", "bench", "--device", device))
    assert f"--device {device!r}: the engine runs on cpu or cuda" in line
    assert bench == []


def test_a_failed_write_after_the_run_keeps_the_tables(bench: list[BenchConfig]) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full to fill a disk")
    result = invoke("engine", "bench", "--json", "/dev/full")
    assert result.exit_code == 2, result.output
    assert "L1+L2+L3" in result.stdout and "TTFT mean" in result.stdout
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]  # past the bars
    assert line == (
        "error: cannot write --json '/dev/full': No space left on device "
        "(the result is printed above)"
    )


def test_a_failed_plot_still_writes_the_json(
    tmp_path: Path, bench: list[BenchConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(engine_cli, "plot_ttft_by_round", full)
    target = tmp_path / "bench.json"
    plot = tmp_path / "ttft.png"
    result = invoke("engine", "bench", "--json", str(target), "--plot", str(plot))
    assert result.exit_code == 2, result.output
    assert f"--plot {str(plot)!r}: No space left on device" in result.stderr
    assert "L1+L2+L3" in result.stdout and json.loads(target.read_text())["runs"]


# -- hicache check --report ---------------------------------------------------------------------


@pytest.mark.parametrize("engine", [False, True])
def test_a_report_directory_below_a_regular_file_is_one_line(tmp_path: Path, engine: bool) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    report = blocker / "report"
    flags = ["--engine"] if engine else []
    line = one_error_line(invoke("check", "memory", "--report", str(report), *flags))
    assert f"--report {str(report)!r}: cannot write a report there: Not a directory" in line


def _fake_engine_check(*args: Any, **kwargs: Any) -> EngineReport:
    logging.getLogger("hicache_storage").warning("a storage call failed on purpose")
    return EngineReport(backend="memory", checks=[EngineCheck(name="case", outcome="passed")])


def test_engine_reports_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_check, "check_engine", _fake_engine_check)
    report = tmp_path / "report"
    result = invoke("check", "memory", "--engine", "--report", str(report))
    assert result.exit_code == 0, result.output
    assert "failed on purpose" in (report / "engine.log").read_text()
    assert json.loads((report / "engine.json").read_text())["backend"] == "memory"
    for name in ("engine.json", "engine.log"):
        assert stat.S_IMODE((report / name).stat().st_mode) == 0o600, name


def test_an_engine_report_that_cannot_be_written_keeps_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_check, "check_engine", _fake_engine_check)
    report = tmp_path / "report"
    (report / "engine.json").mkdir(parents=True)
    result = invoke("check", "memory", "--engine", "--verbose", "--report", str(report))
    assert "engine.json" in one_error_line(result)
    assert "hicache check memory --engine" in result.stdout and "case" in result.stdout


def test_the_suites_log_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_suite(backend: str, options: Any, target: str, **kwargs: Any) -> int:
        kwargs["output"].write(b"pytest output\n")
        write_report(Report(backend=backend, version="0", checks=[]), target)
        return 0

    monkeypatch.setattr(conformance_report, "run_suite", fake_suite)
    report = tmp_path / "report"
    result = invoke("check", "memory", "--report", str(report))
    assert result.exit_code == 0, result.output
    for name in ("pytest.log", "report.json", "report.md"):
        assert stat.S_IMODE((report / name).stat().st_mode) == 0o600, name
