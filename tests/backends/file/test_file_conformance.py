"""The file backend passes the conformance suite, skipping exactly what it does not claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from ...helpers import assert_builtin_passes


@pytest.mark.parametrize(
    ("options", "claims_bounded"),
    # The bound counts the files on disk: room for the suite's 16 MiB page and its records.
    [({}, False), ({"max_bytes": 17 << 20}, True), ({"naming": "sglang_file_compat"}, False)],
    ids=["file", "file-bounded", "file-sglang-compat"],
)
def test_file_backend_passes_suite(
    tmp_path: Path, options: dict[str, object], claims_bounded: bool
) -> None:
    assert_builtin_passes(tmp_path, "file", options, claims_bounded)
