"""The 3FS backend's POSIX files over a directory that holds what it did not write (issue 48).

A data file's path or the lock file's path holding a FIFO, a directory, a socket or a symlink to
one (or to nothing) never hangs the backend's start and never keeps the store from opening: the
entry is cleared, the file created in its place, and values are stored and read as usual.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache_storage import create_backend

from ..file.test_file_hostile_entries import KINDS, bounded, fifo_of, plant, short_root

__all__ = ["short_root"]

GEOMETRY = {"file_size": 1 << 20, "file_count": 2, "slot_bytes": 64 << 10}


@pytest.mark.parametrize("where", ["hicache.0.bin", "hicache.lock"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_that_is_not_a_file_at_a_data_path_is_replaced(
    short_root: Path, kind: str, where: str
) -> None:
    path = str(short_root / where)
    held = plant(path, kind)
    fifo = fifo_of(path, kind)
    try:
        backend = bounded(
            lambda: create_backend("3fs", {"path": str(short_root), **GEOMETRY}), fifo
        )
        try:
            assert backend.set("k", b"v" * 1000)
            assert backend.get("k") == b"v" * 1000
        finally:
            backend.close()
        assert os.path.isfile(path)  # a dangling symlink's target is created, as open() does
    finally:
        for sock in held:
            sock.close()
