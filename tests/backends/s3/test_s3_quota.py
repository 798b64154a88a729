"""Tenants sharing a bucket on the real gateway, each held to a quota through a shared ledger."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from hicache_storage import create_backend
from hicache_storage.config import LayerConfig, QuotaConfig

from .test_s3_backend import object_names

VALUE = 64 * 1024
QUOTA = 8 * VALUE


def test_tenants_share_a_bucket_each_within_its_quota(
    s3_options: dict[str, Any], tmp_path: Path
) -> None:
    base = s3_options["prefix"]

    def tenant(name: str) -> Any:
        ledger = str(tmp_path / f"{name}.sqlite")  # a file on a mount every writer shares
        layers = LayerConfig(quota=QuotaConfig(bytes=QUOTA, ledger=ledger))
        return create_backend("s3", {**s3_options, "prefix": f"{base}{name}/"}, layers=layers)

    quiet, loud = tenant("quiet"), tenant("loud")
    writers = [tenant("loud") for _ in range(3)]  # more processes of the loud tenant
    try:
        for i in range(4):
            assert quiet.set(f"q{i}", bytes([i]) * VALUE)

        def write(w: int) -> None:
            for i in range(12):
                writers[w].set(f"w{w}-{i}", bytes([w]) * VALUE)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        loud_names = [n for n in object_names(s3_options, f"{base}loud/") if "/hcv-" not in n]
        assert 0 < len(loud_names) <= QUOTA // VALUE
        assert loud.stats()["quota"]["pages"] == len(loud_names)
        assert all(quiet.get(f"q{i}") == bytes([i]) * VALUE for i in range(4))
        loud.clear()
        assert quiet.batch_exists([f"q{i}" for i in range(4)]) == 4
    finally:
        for backend in (quiet, loud, *writers):
            backend.clear()
            backend.close()
