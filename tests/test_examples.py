"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, root: Path) -> str:
    """Run ``examples/<name>`` on ``root`` as a user would; return what it printed."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout


def test_quickstart_round_trips(tmp_path: Path) -> None:
    stdout = run_example("quickstart.py", tmp_path)
    assert "prefix hit: 6/6 pages, loaded: True, identical: True" in stdout


def test_mixed_tp_fleet_shares_objects(tmp_path: Path) -> None:
    stdout = run_example("mixed_tp_fleet.py", tmp_path)
    assert "TP1 loaded 8/8 objects, identical to the TP2 ranks' KV: True" in stdout


def test_engine_example_matches_recompute(tmp_path: Path) -> None:
    stdout = run_example("engine.py", tmp_path)
    assert "identical to recompute: True" in stdout
    assert "storage 0;" not in stdout, "the example must show pages coming back from L3"
