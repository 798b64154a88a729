"""The file backend's free-space floor on a real disk that fills (a tmpfs)."""

from __future__ import annotations

import os
from pathlib import Path

from hicache_storage import create_backend

from ...helpers import tmpfs

VALUE = 64 * 1024


def _free(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def test_writes_past_the_floor_evict_the_oldest_and_the_disk_keeps_its_floor(
    tmp_path: Path,
) -> None:
    floor = 256 * 1024
    with tmpfs(tmp_path / "disk") as disk:
        backend = create_backend("file", {"root": str(disk / "root"), "min_free_bytes": floor})
        keys = [f"k{i}" for i in range(40)]  # 2.5 MiB into a 1 MiB disk
        for i, key in enumerate(keys):
            assert backend.set(key, bytes([i]) * VALUE), f"{key} was not stored"
            assert _free(disk) >= floor - VALUE, f"{key} left {_free(disk)} bytes free"
        assert backend.get(keys[-1]) == bytes([39]) * VALUE  # the newest are kept
        assert not backend.exists(keys[0])  # the oldest went first
        stats = backend.stats()
        assert stats["evictions"] > 0 and stats["min_free_bytes"] == floor
        assert stats["free_bytes"] >= floor - VALUE
        backend.close()


def test_the_default_floor_is_a_hundredth_of_the_disk(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", size="4m") as disk:
        backend = create_backend("file", {"root": str(disk / "root")})
        info = os.statvfs(disk)
        assert backend.stats()["min_free_bytes"] == info.f_blocks * info.f_frsize // 100
        backend.close()
        off = create_backend("file", {"root": str(disk / "off"), "min_free_bytes": 0})
        assert off.stats()["min_free_bytes"] == 0
        off.close()
