"""docs/authors.md is true: its code blocks, put together, are a backend that passes the suite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache_storage.conformance.report import load_report, run_suite
from hicache_storage.registry import PLUGINS_ENV

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "authors.md"


def _module() -> str:
    """Return the guide's Python blocks joined in order (the first names the file)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    assert blocks and blocks[0].startswith("# dirkv.py"), "the guide's first block names dirkv.py"
    return "\n\n".join(blocks)


def test_guide_backend_passes_the_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dirkv.py").write_text(_module())
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "dirkv")
    status = run_suite("dirkv", {"root": str(tmp_path / "root")}, tmp_path / "report")
    report = load_report(tmp_path / "report")
    failed = {row.id: row.message for row in report.failures()}
    assert status == 0 and not failed, f"the guide's backend fails the suite: {failed}"
    assert report.backend == "dirkv"
