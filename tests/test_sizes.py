"""The one size rule (``options.bytes_of``): IEC and bare letters are binary, ``KB``-style units
follow the caller's declared convention."""

from __future__ import annotations

import pytest

from hicache_storage.kit.options import bytes_of


@pytest.mark.parametrize(
    ("text", "si", "binary"),
    [
        ("4096", 4096, 4096),
        ("100B", 100, 100),
        ("64K", 64 << 10, 64 << 10),
        ("1Ki", 1 << 10, 1 << 10),
        ("1KiB", 1 << 10, 1 << 10),
        ("1KB", 1000, 1 << 10),
        ("2 mb", 2_000_000, 2 << 20),
        ("4GB", 4 * 10**9, 4 << 30),
        ("1TiB", 1 << 40, 1 << 40),
        (" 1.5 MiB ", 3 << 19, 3 << 19),
    ],
)
def test_units(text: str, si: int, binary: int) -> None:
    assert bytes_of(text, units="si") == si
    assert bytes_of(text, units="binary") == binary


@pytest.mark.parametrize("text", ["", "MiB", "1XB", "-1", "1,2", "512ib", "1KiBB", "1 P", "one"])
def test_not_a_size(text: str) -> None:
    assert bytes_of(text, units="si") is None
    assert bytes_of(text, units="binary") is None
