"""The ``hicache`` command line, driven through click's CliRunner (no timing assertions)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hicache_storage.cli import main

SMALL = ["--page-size", "64KiB", "--batch-size", "4", "--batches", "2", "--repeat", "1"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def bench_json(*args: str) -> dict[str, Any]:
    result = invoke("bench", *args, "--json")
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def check_report(report: dict[str, Any], backend: str) -> None:
    assert report["backend"] == backend
    assert (report["batch_size"], report["batches"], report["repeat"]) == (4, 2, 1)
    (result,) = report["results"]
    assert result["page_size"] == 64 * 1024
    for op in ("set", "get", "raw_write", "raw_read"):
        assert result[op]["keys"] == 4 * 2
        assert result[op]["calls"] == 2
        assert result[op]["nbytes"] == 64 * 1024 * 4 * 2
    assert result["exists"]["keys"] == 8 and result["exists"]["nbytes"] == 0
    assert result["set_ratio"] > 0 and result["get_ratio"] > 0
    assert report["set_ratio"] > 0 and report["get_ratio"] > 0
    assert result["verified"] == 16
    assert report["hashing"]["pages"] > 0 and report["hashing"]["ratio"] > 0


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.startswith("hicache, version ")


def test_backends_table() -> None:
    result = invoke("backends")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for name in ("memory", "file"):
        row = next(line for line in lines if f" {name} " in line)
        assert "built in" in row and "yes" in row


def test_backends_json() -> None:
    result = invoke("backends", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert {"memory", "file"} <= rows.keys()
    for name in ("memory", "file"):
        assert rows[name]["installed"] is True
        assert rows[name]["install"] == "built in"
        assert rows[name]["baseline"] is True
    assert "delete" in rows["memory"]["capabilities"]
    assert "persistent" in rows["file"]["capabilities"]


def test_bench_memory_json() -> None:
    check_report(bench_json("memory", *SMALL), "memory")


def test_bench_memory_table() -> None:
    result = invoke("bench", "memory", *SMALL)
    assert result.exit_code == 0, result.output
    assert "64 KiB" in result.stdout
    assert "hash" in result.stdout
    assert "of raw" in result.stdout


def test_bench_file_with_config(tmp_path: Path) -> None:
    config = json.dumps({"root": str(tmp_path / "store")})
    check_report(bench_json("file", "--config", config, *SMALL), "file")


def test_bench_file_config_from_file(tmp_path: Path) -> None:
    path = tmp_path / "file.json"
    path.write_text(json.dumps({"root": str(tmp_path / "store")}))
    check_report(bench_json("file", "--config", f"@{path}", *SMALL), "file")


def test_bench_file_default_uses_and_removes_a_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    check_report(bench_json("file", *SMALL), "file")
    assert list(tmp_path.iterdir()) == []


def test_unknown_backend_exits_2_listing_registered() -> None:
    result = invoke("bench", "no-such-backend", *SMALL)
    assert result.exit_code == 2
    assert "no-such-backend" in result.stderr
    assert "memory" in result.stderr and "file" in result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_malformed_config_exits_2() -> None:
    result = invoke("bench", "memory", "--config", "{not json", *SMALL)
    assert result.exit_code == 2
    assert "not valid JSON" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_unknown_option_in_config_exits_2() -> None:
    result = invoke("bench", "memory", "--config", '{"bogus": 1}', *SMALL)
    assert result.exit_code == 2
    assert "bogus" in result.stderr


def test_bad_page_size_exits_2() -> None:
    result = invoke("bench", "memory", "--page-size", "lots")
    assert result.exit_code == 2
    assert "lots" in result.stderr


@pytest.mark.parametrize("size", ["64GiB", "1TiB"])
def test_bench_refuses_a_run_that_cannot_fit_in_memory(size: str) -> None:
    """Issue 14 item 10: one line on stderr and exit 2, no traceback, nothing allocated."""
    result = invoke("bench", "memory", "--page-size", size)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert "memory" in result.output and "--page-size" in result.output


def test_kernels_bench_is_a_hicache_command() -> None:
    """``hicache kernels bench`` takes the kernel benchmark's options and refuses a CPU clearly."""
    import torch

    usage = invoke("kernels", "bench", "--help")
    assert usage.exit_code == 0 and "usage: hicache kernels bench" in usage.output
    assert "--page-sizes" in usage.output and "--json" in usage.output
    wrong = invoke("kernels", "bench", "--no-such-option")
    assert wrong.exit_code == 2 and "unrecognized arguments: --no-such-option" in wrong.output
    if not torch.cuda.is_available():  # on a GPU the benchmark itself is run by hand
        refused = invoke("kernels", "bench", "--quick")
        assert refused.exit_code == 2 and "needs a CUDA GPU" in refused.output
