"""The probe scripts behind figures of docs/performance.md run, and say why where they cannot.

Each is run as a reader of the docs would, from the repository root, on this machine's CPU at
the smallest size its options allow; the GPU-only probes must refuse at once, naming the GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_every_probe_script_is_cited_by_the_docs_it_measures_for() -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    probes = sorted(
        p.name for p in SCRIPTS.glob("*.py") if "probe" in p.name or "profile" in p.name
    )
    assert probes
    assert [name for name in probes if f"scripts/{name}" not in docs] == []


@pytest.mark.timeout(120)
def test_probe_bound_prints_the_peak_beside_the_bound(tmp_path: Path) -> None:
    result = _run(
        "scripts/probe_bound.py", "--root", str(tmp_path), "--seconds", "1", "--writers", "2",
        "--bound-mib", "4", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = re.search(
        r"bound 4 MiB; peak on disk [\d.]+ MiB .*accounted ([\d.]+) MiB", result.stdout
    )
    assert found and 0 < float(found[1]) <= 4.0, result.stdout


@pytest.mark.timeout(120)
def test_probe_quota_prints_each_tenants_peak_and_the_quiet_tenant_intact(tmp_path: Path) -> None:
    result = _run(
        "scripts/probe_quota.py", "--root", str(tmp_path), "--seconds", "2", "--writers", "2",
        "--quota-mib", "4", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    peaks = re.findall(r"quota 4 MiB; peak on disk ([\d.]+) MiB", result.stdout)
    assert len(peaks) == 2 and all(0 < float(peak) <= 5.0 for peak in peaks), result.stdout
    assert "tenant quiet: 2 of 2 values intact" in result.stdout


@pytest.mark.timeout(300)
def test_probe_chain_working_set_prints_each_configuration() -> None:
    result = _run(
        "scripts/probe_chain_working_set.py", "--values", "16", "--reads", "200", timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = {
        line.split("  hit rate")[0].strip(): line
        for line in result.stdout.splitlines()
        if "hit rate" in line
    }
    assert set(rows) == {"file alone (bounded)", "redis alone", "chain file -> redis"}, rows
    assert (
        "hit rate 100.0%" in rows["redis alone"]
        and "hit rate 100.0%" in rows["chain file -> redis"]
    )


@pytest.mark.timeout(600)
def test_probe_verify_prints_each_rate_beside_the_raw_read() -> None:
    result = _run("scripts/probe_verify.py", "--pages", "4", "--threads", "1,2")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"\s*\d+ threads:", line)]
    assert len(rows) == 2 and all("GB/s" in row for row in rows), result.stdout
    assert "checksum GB/s" in result.stdout


@pytest.mark.timeout(600)
def test_profile_forward_times_each_forward_with_and_without_graphs_on_cpu() -> None:
    result = _run("scripts/profile_forward.py", "--model", "tiny", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["forward", "graphs"]
    rows = [line for line in lines[1:] if line.strip()]
    assert len(rows) == 8 and {row.split()[-5] for row in rows} >= {"False", "True"}, lines


@pytest.mark.timeout(900)
def test_probe_gil_tax_prints_the_forward_beside_each_storage_loop() -> None:
    result = _run(
        "scripts/probe_gil_tax.py", "--device", "cpu", "--model", "tiny", "--repeat", "1",
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if re.search(r"\d+\.\d+\s*$", line)]
    assert len(rows) >= 4, result.stdout
    ratios = [float(row.split()[-1]) for row in rows]
    assert all(ratio > 0 for ratio in ratios)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: the probe would run, not refuse"
)
@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("probe_attention_shapes.py", "needs a GPU"),
        ("gpu_probe.py", "needs a CUDA GPU"),
    ],
)
def test_gpu_only_probes_refuse_without_a_gpu_and_say_so(script: str, message: str) -> None:
    result = _run(f"scripts/{script}", timeout=120)
    assert result.returncode != 0
    assert message in result.stderr
