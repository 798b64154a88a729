"""The library side of ``hicache bench``: size parsing, the report, and refusing wrong answers."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from hicache_storage import ConfigError, register_plugin, unregister_plugin
from hicache_storage.bench.backend import (
    BenchError,
    BenchReport,
    bench_hashing,
    parse_size,
    parse_sizes,
    run_bench,
)
from hicache_storage.bench.report import format_size


def small_run(name: str, page_sizes: list[int]) -> BenchReport:
    """Three keys per batch, two batches, two repeats, a token-sized hashing run."""
    return run_bench(
        name, None, page_sizes=page_sizes, batch_size=3, batches=2, repeat=2, hash_tokens=1000
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1MiB", 1024**2),
        ("4mib", 4 * 1024**2),
        ("64KiB", 64 * 1024),
        ("64K", 64 * 1024),
        ("1KB", 1000),
        ("2MB", 2_000_000),
        ("1GiB", 1024**3),
        ("1.5MiB", 3 * 512 * 1024),
        (" 8 KiB ", 8192),
        ("100B", 100),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "1XB", "-1MiB", "0", "0.5", "1.3B", "1,2"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_parse_sizes_keeps_order() -> None:
    assert parse_sizes("1MiB,4MiB,64KiB") == [1024**2, 4 * 1024**2, 64 * 1024]
    assert parse_sizes("1MiB, 4MiB,") == [1024**2, 4 * 1024**2]
    with pytest.raises(ConfigError):
        parse_sizes(" , ")


def test_format_size() -> None:
    assert format_size(4 * 1024**2) == "4 MiB"
    assert format_size(64 * 1024) == "64 KiB"
    assert format_size(1000) == "1000 B"
    assert format_size(1536) == "1536 B"


def test_run_bench_memory_report() -> None:
    report = small_run("memory", [4096, 1000])
    assert [r.page_size for r in report.results] == [4096, 1000]
    for result in report.results:
        keys = 3 * 2 * 2
        for stats in (result.set, result.get, result.raw_write, result.raw_read):
            assert stats is not None
            assert stats.keys == keys
            assert stats.calls == 2 * 2
            assert stats.nbytes == keys * result.page_size
            assert stats.gb_per_s is not None and stats.gb_per_s > 0
            assert stats.p99_ms >= stats.p50_ms >= 0
        assert result.exists.nbytes == 0 and result.exists.gb_per_s is None
        assert result.set_ratio is not None and result.set_ratio > 0
        assert result.get_ratio is not None and result.get_ratio > 0
        assert result.verified == 2 * keys
        assert result.cleanup == "deleted"
    assert report.set_ratio is not None and report.get_ratio is not None
    # The JSON form round-trips.
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=BenchReport)
    assert decoded == report


def test_run_bench_validates_parameters() -> None:
    with pytest.raises(ConfigError):
        run_bench("memory", None, page_sizes=[], batch_size=1, batches=1, repeat=1)
    with pytest.raises(ConfigError):
        run_bench("memory", None, page_sizes=[10], batch_size=0, batches=1, repeat=1)
    with pytest.raises(ConfigError, match="unknown field"):
        run_bench("memory", {"bogus": 1}, page_sizes=[10], batch_size=1, batches=1, repeat=1)


def test_bench_hashing() -> None:
    stats = bench_hashing(tokens=1000, page_tokens=64, repeat=2, seed=1)
    assert stats.pages == 16  # the last, partial page is hashed too
    assert stats.nbytes == 4000
    assert stats.pages_per_s > 0 and stats.raw_pages_per_s > 0 and stats.ratio > 0


@pytest.fixture
def broken_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The specs name their factories "bench_helpers:...", so tests/ must be importable.
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plugin = importlib.import_module("bench_helpers").BrokenBackends()
    register_plugin(plugin, name="bench-test-broken-backends")
    try:
        yield
    finally:
        unregister_plugin(plugin)


@pytest.mark.usefixtures("broken_backends")
def test_run_bench_refuses_wrong_bytes() -> None:
    with pytest.raises(BenchError, match="wrong bytes"):
        small_run("corrupting", [4096])


@pytest.mark.usefixtures("broken_backends")
@pytest.mark.parametrize(
    ("name", "message"), [("corrupting-v1", "wrong bytes"), ("stray", "outside its pages")]
)
def test_run_bench_v1_checks_every_page(name: str, message: str) -> None:
    """The v1 mode compares each batch's pages as it reads them, and the whole pool per pass."""
    with pytest.raises(BenchError, match=message):
        run_bench(name, None, page_sizes=[4096], batch_size=3, batches=3, repeat=1, mode="v1")


@pytest.mark.usefixtures("broken_backends")
def test_run_bench_refuses_misses() -> None:
    with pytest.raises(BenchError, match="missed"):
        small_run("forgetful", [4096])


@pytest.mark.usefixtures("broken_backends")
def test_run_bench_without_baseline_has_no_ratios() -> None:
    report = small_run("nobaseline", [512])
    (result,) = report.results
    assert result.raw_write is None and result.raw_read is None
    assert result.set_ratio is None and result.get_ratio is None
    assert report.set_ratio is None and report.get_ratio is None
    assert result.verified == 3 * 2 * 2
