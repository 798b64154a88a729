"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_quickstart_round_trips(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "prefix hit: 6/6 pages, loaded: True, identical: True" in result.stdout


def test_mixed_tp_fleet_shares_objects(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "mixed_tp_fleet.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "TP1 loaded 8/8 objects, identical to the TP2 ranks' KV: True" in result.stdout


def test_engine_example_matches_recompute(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "engine.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "identical to recompute: True" in result.stdout
    assert "storage 0;" not in result.stdout, "the example must show pages coming back from L3"
