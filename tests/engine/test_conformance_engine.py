"""The engine check passes on every built-in backend and fails a backend that serves wrong pages.

The memory and file backends run the whole policy matrix and every scenario; the server backends
(on the local servers the project provisions, as their own tests do) run a storage round trip, a
deletion and a fault case, and Redis and the 3FS metadata service have their server stopped mid-run
through the server-control hook. A server that cannot be started fails the test.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import StorageBackend, create_backend
from hicache_storage.config import LayerConfig
from hicache_storage.conformance.engine import (
    DEFAULT_CASES,
    POLICIES,
    EngineReport,
    case_names,
    check_engine,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.report import load_report, run_suite
from hicache_storage.conformance.server import find_server_control
from hicache_storage.errors import ConfigError
from hicache_storage.kit.services import LocalService
from hicache_storage.layers import ForwardingBackend

from .conftest import THREEFS_GEOMETRY, THREEFS_TIMEOUT_S

SERVER_CASES = ["write_through/wait_complete", "fresh_engine", "missing_pages", "failed_loads"]
"""What each server backend runs: a storage round trip, deleted pages and failing calls."""

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is faster without intra-op threads
    yield
    torch.set_num_threads(threads)
    if TIMINGS:
        print("engine check:", ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))


def run_check(
    label: str, factory: Any, cases: Sequence[str] | None = None, **kw: Any
) -> EngineReport:
    start = time.monotonic()
    report = check_engine(factory, cases=cases, **kw)
    TIMINGS[label] = time.monotonic() - start
    return report


def assert_passes(report: EngineReport, *, server_case: bool = False) -> None:
    """Every case passed; with ``server_case``, the server cases ran (not skipped)."""
    failures = report.failures()
    assert not failures, "\n".join(f"{c.name} {c.outcome}: {c.message}" for c in failures)
    if server_case:
        ran = [c for c in report.checks if c.name.startswith("server_")]
        assert ran and all(c.outcome != "skipped" for c in ran), [c.message for c in ran]


# -- memory and file: every case ------------------------------------------------------------------


def test_memory_passes_every_case() -> None:
    report = run_check("memory", BackendFactory("memory"))
    assert [c.name for c in report.checks] == case_names(POLICIES, DEFAULT_CASES)
    assert_passes(report)
    assert report.check("server_stop").outcome == "skipped"
    assert report.check("fresh_engine").stats["fresh_storage_hit_tokens"] > 0
    assert report.check("failed_loads").stats["faults"] > 0
    assert report.check("late_pages").stats["prefetch_pages_cut"] > 0
    assert report.duration_s < 30, f"the memory check took {report.duration_s:.1f} s"


def test_file_passes_every_case(tmp_path: Path) -> None:
    report = run_check("file", BackendFactory("file", {"root": str(tmp_path)}))
    assert_passes(report)
    assert report.check("missing_pages").stats["deleted_pages"] > 0


# -- servers (tests/engine/conftest.py) ------------------------------------------------------------


def prefix(separator: str = "/") -> str:
    return f"engine-{secrets.token_hex(4)}{separator}"


def test_redis_standalone_passes_and_survives_a_stopped_server(
    redis_standalone: LocalService,
) -> None:
    factory = BackendFactory("redis", {**redis_standalone.options, "prefix": prefix(":")})
    control = find_server_control("redis", factory.options)
    assert control is not None, "the published Redis service is the server control"
    report = run_check("redis", factory, [*SERVER_CASES, "server_stop"], server_control=control)
    assert isinstance(control, LocalService) and control.running(), "restarted after the check"
    assert_passes(report, server_case=True)


def test_redis_cluster_passes(redis_cluster: LocalService) -> None:
    factory = BackendFactory("redis", {**redis_cluster.options, "prefix": prefix(":")})
    assert_passes(run_check("redis-cluster", factory, SERVER_CASES))


def test_s3_passes(s3_service: LocalService) -> None:
    factory = BackendFactory("s3", {**s3_service.options, "prefix": prefix()})
    assert_passes(run_check("s3", factory, SERVER_CASES))


def test_mooncake_passes(mooncake_store: LocalService) -> None:
    options = {
        "master": mooncake_store.options["master"],
        "global_segment_size": 0,
        "local_hostname": "127.0.0.1",
        "prefix": prefix(),
    }
    assert_passes(run_check("mooncake", BackendFactory("mooncake", options), SERVER_CASES))


def test_threefs_in_process_passes(tmp_path: Path) -> None:
    factory = BackendFactory("3fs", {"path": str(tmp_path / "store"), **THREEFS_GEOMETRY})
    assert_passes(run_check("3fs", factory, SERVER_CASES))


def test_threefs_service_passes_and_survives_a_stopped_server(
    metadata_service: LocalService, tmp_path: Path
) -> None:
    options = {
        "path": str(tmp_path / "store"),
        **THREEFS_GEOMETRY,
        **metadata_service.options,
        "timeout_s": THREEFS_TIMEOUT_S,
    }
    factory = BackendFactory("3fs", options)
    control = find_server_control("3fs", factory.options)
    assert control is not None, "the published metadata service is the server control"
    report = run_check(
        "3fs-service", factory, [*SERVER_CASES, "server_stop"], server_control=control
    )
    assert isinstance(control, LocalService) and control.running(), "restarted after the check"
    assert_passes(report, server_case=True)


def test_unreachable_server_fails_every_case() -> None:
    factory = BackendFactory(
        "redis", {"url": "redis://127.0.0.1:1/0", "deadline_s": 0.5, "connect_timeout_s": 0.2}
    )
    report = run_check("unreachable", factory, ["write_through/wait_complete", "fresh_engine"])
    assert [c.outcome for c in report.checks] == ["error", "error"], report.checks
    assert all("cannot reach redis" in (c.message or "") for c in report.checks)


# -- the harness has teeth ------------------------------------------------------------------------


class FirstKeyEveryPage(ForwardingBackend):
    """A batched read whose loop never advances: every page gets the first key's bytes.

    (Pages merely permuted within a fetch would go unnoticed, rightly: attention over a prefix
    does not depend on the order of its keys and values, which carry their positions.)
    """

    def batch_get_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        return self.inner.batch_get_v1([keys[0]] * len(keys), host_indices)


class HitsWithoutData(ForwardingBackend):
    """Loses every other page of a write yet claims them all, and reads a lost one as a hit.

    A lost page's host slots keep whatever they held before: stale KV of another page.
    """

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        page = len(host_indices) // len(keys)
        kept = [host_indices[i * page : (i + 1) * page] for i in range(0, len(keys), 2)]
        self.inner.batch_set_v1(list(keys[::2]), torch.cat(kept))
        return [True] * len(keys)

    def batch_exists(self, keys: Sequence[str]) -> int:
        return len(keys)

    def batch_get_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        self.inner.batch_get_v1(keys, host_indices)
        return [True] * len(keys)


class Broken:
    """A factory of memory backends wrapped in a bug (outside the default layers)."""

    def __init__(self, bug: type[ForwardingBackend]) -> None:
        self.name = f"broken-{bug.__name__}"
        self.bug = bug

    def __call__(self, layers: LayerConfig | None = None) -> StorageBackend:
        return self.bug(create_backend("memory", layers=layers))


@pytest.mark.parametrize("bug", [FirstKeyEveryPage, HitsWithoutData], ids=lambda b: b.__name__)
def test_backend_serving_wrong_pages_fails_with_the_request_and_position(
    bug: type[ForwardingBackend],
) -> None:
    report = run_check(bug.__name__, Broken(bug), ["write_through/wait_complete", "fresh_engine"])
    assert not report.passed
    failed = report.failures()
    assert all(c.outcome == "failed" for c in failed), failed
    message = failed[0].message or ""
    assert "differs from recompute at output token" in message, message
    assert "request client " in message and " round " in message, message
    with pytest.raises(AssertionError, match="engine case"):
        report.assert_passed()


class LosesPages(ForwardingBackend):
    """Writes every page, then silently loses every other one (reads and existence stay true).

    With ``bounded`` it declares the capacity that makes such losses legitimate evictions.
    """

    def __init__(self, inner: StorageBackend, *, bounded: bool) -> None:
        super().__init__(inner)
        self.capabilities = dataclasses.replace(inner.capabilities, bounded=bounded, delete=True)

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        done = self.inner.batch_set_v1(keys, host_indices)
        for key in keys[1::2]:
            self.inner.delete(key)
        return done


class Losing:
    """A factory of memory backends that lose pages, declaring ``bounded`` or not."""

    def __init__(self, *, bounded: bool) -> None:
        self.name = f"losing-bounded-{bounded}"
        self.bounded = bounded

    def __call__(self, layers: LayerConfig | None = None) -> StorageBackend:
        return LosesPages(create_backend("memory", layers=layers), bounded=self.bounded)


def test_a_bounded_store_that_evicts_passes_and_an_unbounded_one_that_loses_pages_fails(
    tmp_path: Path,
) -> None:
    cases = ["missing_pages", "late_pages"]
    small = BackendFactory("file", {"root": str(tmp_path), "max_bytes": 20000})
    report = run_check("file-bounded", small, cases)
    assert_passes(report)  # evictions of a bounded store are no failure
    assert report.check("missing_pages").stats.get("evicted_pages", 0) > 0
    assert_passes(run_check("losing-bounded", Losing(bounded=True), ["missing_pages"]))
    lossy = run_check("losing-unbounded", Losing(bounded=False), ["missing_pages"])
    check = lossy.check("missing_pages")
    assert check.outcome == "failed" and "delete() found" in (check.message or ""), check


def test_unknown_case_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown engine cases \\['nope'\\]"):
        check_engine(BackendFactory("memory"), cases=["nope"])


# -- the pytest plugin ----------------------------------------------------------------------------


def test_plugin_runs_the_engine_cases_with_hicache_engine(tmp_path: Path) -> None:
    status = run_suite("memory", None, tmp_path, ["--hicache-engine", "-k", "TestEngine"])
    report = load_report(tmp_path)
    outcomes = {c.id.split("[", 1)[1].rstrip("]"): c.outcome for c in report.checks}
    assert status == 0, outcomes
    assert set(outcomes) == set(case_names(POLICIES, DEFAULT_CASES))
    assert outcomes.pop("server_stop") == "skipped"
    assert set(outcomes.values()) == {"passed"}
