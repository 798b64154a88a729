"""The memory backend passes the conformance suite, skipping exactly what it does not claim."""

from __future__ import annotations

from pathlib import Path

from ...helpers import assert_builtin_passes


def test_memory_backend_passes_suite(tmp_path: Path) -> None:
    assert_builtin_passes(tmp_path, "memory", None, claims_bounded=False)
