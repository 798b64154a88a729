"""docs/authors.md is true: its code blocks, put together, are a backend that passes the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_storage.conformance.report import _child_env, load_report, run_suite
from hicache_storage.registry import PLUGINS_ENV

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "authors.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


def _module() -> str:
    """Return dirkv.py: the guide's Python blocks from the one that names it, joined in order."""
    blocks = _blocks()
    first = next(i for i, block in enumerate(blocks) if block.startswith("# dirkv.py"))
    return "\n\n".join(blocks[first:])


def test_the_smallest_backend_passes_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Section 0's tinykv.py, as its console block runs it.
    (tiny,) = [block for block in _blocks() if block.startswith("# tinykv.py")]
    assert re.findall(r"^    def (\w+)\(", tiny, flags=re.MULTILINE) == [
        "__init__",
        "get",
        "exists",
        "set",
    ]
    (tmp_path / "tinykv.py").write_text(tiny)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ".")
    monkeypatch.setenv(PLUGINS_ENV, "tinykv")
    status = run_suite("tinykv", None, tmp_path / "report")
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    assert status == 0 and not failed, f"the smallest backend fails the suite: {failed}"
    assert report.capabilities == [] and report.version == "unknown"


def test_guide_backend_passes_the_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the guide runs it: `HICACHE_PLUGINS=dirkv PYTHONPATH=. hicache check dirkv`, from the
    # directory that holds dirkv.py (the suite itself runs in a temporary directory).
    (tmp_path / "dirkv.py").write_text(_module())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", ".")
    monkeypatch.setenv(PLUGINS_ENV, "dirkv")
    status = run_suite("dirkv", {"root": str(tmp_path / "root")}, tmp_path / "report")
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    assert status == 0 and not failed, f"the guide's backend fails the suite: {failed}"
    assert report.backend == "dirkv"
    assert report.version == "0.1.0" == re.search(r'__version__ = "(.*)"', _module())[1]


def test_relative_paths_of_the_caller_reach_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The suite's process runs in a temporary directory; `--config @opts.json` and an empty
    # PYTHONPATH entry (the working directory) are the caller's. `-k` selects no check: exit 5
    # means pytest started with the config read (an unreadable one is a usage error, 4).
    (tmp_path / "opts.json").write_text(json.dumps({"root": str(tmp_path / "root")}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", "."]))
    assert _child_env()["PYTHONPATH"] == os.pathsep.join([os.getcwd()] * 2)
    status = run_suite("file", "@opts.json", tmp_path / "report", ["-k", "no_such_check"])
    assert status == 5


def test_pytest_gives_a_backend_that_needs_a_root_a_temporary_one(tmp_path: Path) -> None:
    # `pytest --hicache-backend file` with no --hicache-config, as `hicache check file` runs it.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--hicache-backend",
            "file",
            "--basetemp",
            str(tmp_path / "base"),
            "-q",
            "-k",
            "TestRoundTrip and get_matches or TestPersistence",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b(\d+) passed", done.stdout), done.stdout[-2000:]
    assert list((tmp_path / "base").glob("hicache*/root")), "the store's root is a temporary one"


def test_the_guide_baseline_gives_bench_its_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Section 9: `hicache bench dirkv` prints ratios to the guide's DirKVBaseline.
    (tmp_path / "dirkv.py").write_text(_module())
    env = {**os.environ, "PYTHONPATH": str(tmp_path), PLUGINS_ENV: "dirkv"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from hicache_storage.cli import main; main()",
            "bench",
            "dirkv",
            "--page-size",
            "64KiB",
            "--batch-size",
            "2",
            "--batches",
            "2",
            "--repeat",
            "1",
            "--json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["backend"] == "dirkv"
    assert report["set_ratio"] > 0 and report["get_ratio"] > 0
