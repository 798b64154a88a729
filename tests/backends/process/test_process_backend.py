"""The process backend: another backend served from a storage process over a shared host pool."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.backends.process.launcher import launcher
from hicache_storage.bench.engine import run_bench
from hicache_storage.config import LayerConfig
from hicache_storage.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    HostPoolError,
    UnknownBackendError,
)
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kit.services import freeze

from ...engine.test_bench import SMALL
from ...helpers import assert_conforms, passing_suite

PAGE = 4
BARE = LayerConfig(metrics=False, degrade=False)


def _pool(*, shared: bool = True) -> MHAHostPool:
    return MHAHostPool(8 * PAGE, PAGE, 2, 2, 8, torch.float16, "page_first", False, shared=shared)


def _served(root: Path, **options: Any) -> dict[str, Any]:
    return {"backend": "file", "options": {"root": str(root)}, **options}


def _pid(backend: StorageBackend) -> int:
    pid: int = backend.stats()["process"]["pid"]
    return pid


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[StorageBackend]:
    backend = create_backend("process", _served(tmp_path / "store"), layers=BARE)
    yield backend
    backend.close()


@pytest.mark.timeout(900)
def test_file_served_from_a_process_passes_the_suite(tmp_path: Path) -> None:
    config = _served(tmp_path / "store")
    report = passing_suite("process", config, tmp_path / "report")
    assert "shared_host_pool" in report.capabilities and "persistent" in report.capabilities
    assert_conforms(report)


def _page(pool: MHAHostPool, page: int) -> bytes:
    out = bytearray(pool.page_nbytes)
    pool.read_page(page * PAGE, out)
    return bytes(out)


def test_pages_move_in_place_and_another_process_reads_them(tmp_path: Path) -> None:
    pool = _pool()
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    written = [_page(pool, page) for page in range(3)]
    keys = ["a", "b", "c"]
    with create_backend("process", _served(tmp_path / "store")) as backend:
        backend.register_host_pool(pool)
        assert backend.batch_set_v1(keys, torch.arange(3 * PAGE)) == [True, True, True]
        raw.zero_()
        hits = backend.batch_get_v1([*keys, "missing"], torch.arange(4 * PAGE))
        assert hits == [True, True, True, False]
    assert [_page(pool, page) for page in range(3)] == written
    assert not any(_page(pool, 3))  # the miss left its page alone
    # The storage process wrote the file backend's own objects: a plain file backend reads them.
    with create_backend("file", {"root": str(tmp_path / "store")}) as direct:
        value = direct.get("b")
        assert value is not None and bytes(value) == written[1]


def test_a_pool_outside_shared_memory_is_refused_with_the_fix(bare: StorageBackend) -> None:
    with pytest.raises(HostPoolError, match="shared=True"):
        bare.register_host_pool(_pool(shared=False))


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"backend": "nosuch"}, UnknownBackendError, "nosuch"),
        ({"backend": "process"}, ConfigError, "another process backend"),
        ({"backend": "file", "options": {"root": "/tmp/x", "bogus": 1}}, ConfigError, "bogus"),
        ({"backend": "file", "threads": 0}, ConfigError, "threads"),
        ({"backend": "file", "call_timeout_s": 0}, ConfigError, "call_timeout_s"),
        ({"options": {}}, ConfigError, "backend"),
    ],
)
def test_bad_config_fails_before_a_process_starts(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        create_backend("process", options)


def test_a_backend_that_cannot_start_raises_its_own_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(Exception, match="a-file") as caught:
        create_backend("process", _served(blocker / "store"))
    assert not isinstance(caught.value, BackendTimeoutError)


def test_a_lost_storage_process_makes_calls_fail_fast_and_layers_miss(tmp_path: Path) -> None:
    pool = _pool()
    with create_backend("process", _served(tmp_path / "store")) as backend:
        backend.register_host_pool(pool)
        assert backend.batch_set_v1(["a"], torch.arange(PAGE)) == [True]
        pid = _pid(backend)
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid)
        began = time.monotonic()
        assert backend.batch_get_v1(["a"], torch.arange(PAGE)) == [False]  # degrade layer
        assert backend.exists("a") is False
        assert time.monotonic() - began < 5.0
        assert backend.stats()["process"]["running"] is False


def test_a_lost_storage_process_raises_typed_errors_bare(bare: StorageBackend) -> None:
    pid = _pid(bare)
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)
    for _ in range(50):  # the reply reader notices the closed socket
        try:
            bare.exists("a")
        except BackendUnavailableError as exc:
            assert str(pid) in str(exc)
            break
        time.sleep(0.05)
    else:
        pytest.fail("calls to a dead storage process kept succeeding")


def test_a_hung_storage_process_times_out_within_the_bound(tmp_path: Path) -> None:
    backend = create_backend(
        "process", _served(tmp_path / "store", call_timeout_s=0.5), layers=BARE
    )
    pid = _pid(backend)
    freeze(pid)
    try:
        began = time.monotonic()
        with pytest.raises(BackendTimeoutError, match=r"0\.5 s"):
            backend.exists("a")
        assert time.monotonic() - began < 2.0
    finally:
        os.kill(pid, signal.SIGCONT)
    backend.close()
    assert _gone(pid)


def test_close_ends_the_storage_process(bare: StorageBackend) -> None:
    pid = _pid(bare)
    bare.set("k", b"value")
    bare.close()
    assert _gone(pid)
    assert "serving 'file'" in repr(bare)


def test_a_dead_launcher_is_replaced(tmp_path: Path) -> None:
    with create_backend("process", _served(tmp_path / "one")) as first:
        first.set("k", b"1")
    process = launcher()._process
    assert process is not None
    process.kill()
    process.wait()
    with create_backend("process", _served(tmp_path / "two")) as second:
        second.set("k", b"2")
        value = second.get("k")
        assert value is not None and bytes(value) == b"2"


def test_the_engine_serves_from_a_storage_process_like_from_the_backend_itself(
    tmp_path: Path,
) -> None:
    direct = run_bench(
        dataclasses.replace(SMALL, backend="file", backend_config={"root": str(tmp_path / "a")}),
        runs=["L1+L2+L3"],
    ).run("L1+L2+L3")
    served = run_bench(
        dataclasses.replace(SMALL, backend="process", backend_config=_served(tmp_path / "b")),
        runs=["L1+L2+L3"],
    ).run("L1+L2+L3")
    # Both serve the no-cache tokens from pages they stored; how many pages are stored and read
    # depends on the measured speed of each (the prefetch and write policies price the store).
    for run in (direct, served):
        assert run.identical and run.storage_hit_tokens > 0 and run.storage_bytes_written > 0
        assert run.storage_bytes_read > 0
