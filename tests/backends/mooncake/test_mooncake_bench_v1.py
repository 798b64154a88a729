"""`hicache bench mooncake` in both modes, beside the raw client on the same buffers."""

from __future__ import annotations

import pytest

from hicache_storage.bench.backend import run_bench
from hicache_storage.errors import ConfigError


@pytest.mark.parametrize("mode", ["copy", "v1"])
def test_bench_reports_backend_beside_raw(options: dict[str, object], mode: str) -> None:
    report = run_bench(
        "mooncake",
        options,
        page_sizes=[4096],
        batch_size=3,
        batches=2,
        repeat=2,
        hash_tokens=1000,
        mode=mode,  # type: ignore[arg-type]
        layout="layer_first",
    )
    assert report.mode == ("copy" if mode == "copy" else "v1:layer_first")
    (result,) = report.results
    assert result.raw_write is not None and result.raw_read is not None
    assert result.set.keys == result.get.keys == result.raw_read.keys == 12
    assert result.set_ratio is not None and result.get_ratio is not None
    assert result.verified == 24 and result.cleanup == "deleted"


def test_bench_v1_needs_whole_heads_and_a_v1_baseline(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="multiples of 256"):
        run_bench(
            "mooncake", options, page_sizes=[1000], batch_size=1, batches=1, repeat=1, mode="v1"
        )
    with pytest.raises(ConfigError, match="no v1 mode"):
        run_bench("memory", None, page_sizes=[4096], batch_size=1, batches=1, repeat=1, mode="v1")
