"""The process backend: another backend served from a storage process over a shared host pool."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
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
    """Return whether process ``pid`` is dead (a zombie counts: it runs no more) within the time."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[StorageBackend]:
    backend = create_backend("process", _served(tmp_path / "store"), layers=BARE)
    yield backend
    backend.close()


@pytest.mark.timeout(900)
def test_file_served_from_a_process_passes_the_suite(tmp_path: Path) -> None:
    # Short calls: the fault checks pause the storage process past call_timeout_s.
    config = _served(tmp_path / "store", call_timeout_s=2.0)
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


def _served_again(backend: StorageBackend, pid: int, within_s: float = 30.0) -> int:
    """Wait until a storage process other than ``pid`` serves ``backend``; return its pid."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stats = backend.stats()["process"]
        if stats["pid"] != pid and stats["running"]:
            new: int = stats["pid"]
            return new
        time.sleep(0.02)
    pytest.fail(f"no storage process replaced {pid} within {within_s} s")


def test_a_lost_storage_process_is_replaced_and_the_pool_registered_again(
    tmp_path: Path,
) -> None:
    pool = _pool()
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    written = _page(pool, 0)
    with create_backend("process", _served(tmp_path / "store")) as backend:
        backend.register_host_pool(pool)
        assert backend.batch_set_v1(["a"], torch.arange(PAGE)) == [True]
        pid = _pid(backend)
        os.kill(pid, signal.SIGKILL)  # the OOM killer, a segfault in a client library
        assert _gone(pid)
        began = time.monotonic()
        # Until the new process serves, every call is a miss at once (degrade layer).
        assert backend.batch_get_v1(["a"], torch.arange(PAGE, 2 * PAGE)) in ([False], [True])
        assert time.monotonic() - began < 5.0
        _served_again(backend, pid)
        raw.zero_()
        deadline = time.monotonic() + 30.0  # the health layer probes before it asks again
        while backend.batch_get_v1(["a"], torch.arange(PAGE)) != [True]:
            assert time.monotonic() < deadline, "the new storage process never served a hit"
            time.sleep(0.05)
        assert _page(pool, 0) == written
        assert backend.stats()["process"]["restarts"] == 1
        assert str(pid) in backend.stats()["process"]["lost"]


def test_calls_to_a_dead_storage_process_fail_fast_with_a_typed_error(
    bare: StorageBackend,
) -> None:
    pid = _pid(bare)
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid)
    for _ in range(200):
        began = time.monotonic()
        try:
            bare.exists("a")
        except BackendUnavailableError as exc:
            assert str(pid) in str(exc) and time.monotonic() - began < 1.0
            return
        if _pid(bare) != pid:
            return  # already replaced: the call was served by the new process
        time.sleep(0.005)
    pytest.fail("calls to a dead storage process neither failed nor reached a new one")


def test_a_hung_storage_process_times_out_within_the_bound_and_is_killed(
    tmp_path: Path,
) -> None:
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
        assert _gone(pid, within_s=0.0)  # dead before the call returned
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    _served_again(backend, pid)
    assert backend.exists("a") is False
    backend.close()


def _resume_and_settle(backend: StorageBackend, pid: int) -> None:
    """Let a paused storage process run again, then give a late call every chance to act."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # a round trip through whichever process serves now
        try:
            backend.exists("settle")
            break
        except (BackendUnavailableError, BackendTimeoutError):
            time.sleep(0.05)
    time.sleep(0.5)


def test_a_read_that_timed_out_never_writes_the_slots_afterwards(tmp_path: Path) -> None:
    pool = _pool()
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    backend = create_backend(
        "process", _served(tmp_path / "store", call_timeout_s=0.5), layers=BARE
    )
    try:
        backend.register_host_pool(pool)
        keys = [f"r{i}" for i in range(4)]
        assert backend.batch_set_v1(keys, torch.arange(4 * PAGE)) == [True] * 4
        pid = _pid(backend)
        freeze(pid)
        # The verify layer reads the pages' records beside the pages: whichever of the two calls
        # times out first declares the process lost, and the other then fails as unavailable.
        with pytest.raises((BackendTimeoutError, BackendUnavailableError)):
            backend.batch_get_v1(keys, torch.arange(4 * PAGE, 8 * PAGE))
        # The engine reuses the slots for other KV as soon as the call has returned.
        reused = torch.randint(0, 256, (4 * pool.page_nbytes,), dtype=torch.uint8)
        slots = [pool.page_nbytes * page for page in range(4, 8)]
        for i, offset in enumerate(slots):
            raw[offset : offset + pool.page_nbytes] = reused[i * pool.page_nbytes :][
                : pool.page_nbytes
            ]
        _resume_and_settle(backend, pid)
        after = torch.cat([raw[offset : offset + pool.page_nbytes] for offset in slots])
        assert torch.equal(after, reused), "a read that had returned wrote into reused slots"
    finally:
        backend.close()


def test_a_write_that_timed_out_never_stores_the_reused_slots(tmp_path: Path) -> None:
    pool = _pool()
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    original = [_page(pool, page) for page in range(4)]
    backend = create_backend(
        "process", _served(tmp_path / "store", call_timeout_s=0.5), layers=BARE
    )
    keys = [f"w{i}" for i in range(4)]
    try:
        backend.register_host_pool(pool)
        pid = _pid(backend)
        freeze(pid)
        with pytest.raises(BackendTimeoutError):
            backend.batch_set_v1(keys, torch.arange(4 * PAGE))
        raw[: 4 * pool.page_nbytes] = torch.randint(
            0, 256, (4 * pool.page_nbytes,), dtype=torch.uint8
        )  # slots reused for other KV
        _resume_and_settle(backend, pid)
    finally:
        backend.close()
    with create_backend("file", {"root": str(tmp_path / "store")}) as direct:
        for key, value in zip(keys, original, strict=True):
            got = direct.get(key)
            assert got is None or bytes(got) == value, f"{key} holds bytes written after return"


def test_a_paused_storage_process_never_blocks_a_sender_or_close(tmp_path: Path) -> None:
    backend = create_backend(
        "process", _served(tmp_path / "store", call_timeout_s=1.0), layers=BARE
    )
    pid = _pid(backend)
    freeze(pid)
    big = bytes(64 << 20)  # more than any socket buffer holds
    outcomes: list[object] = []

    def write(key: str) -> None:
        began = time.monotonic()
        try:
            outcomes.append(backend.set(key, big))
        except (BackendTimeoutError, BackendUnavailableError) as exc:
            outcomes.append(type(exc))
        outcomes.append(time.monotonic() - began)

    try:
        threads = [threading.Thread(target=write, args=(f"k{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10.0)
        assert not any(thread.is_alive() for thread in threads), "a set blocked on the socket"
        durations = [outcome for outcome in outcomes if isinstance(outcome, float)]
        assert len(durations) == 3 and max(durations) < 3.0, durations
        began = time.monotonic()
        backend.close()
        assert time.monotonic() - began < 15.0
        assert _gone(pid, within_s=0.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_close_ends_a_paused_storage_process(tmp_path: Path) -> None:
    backend = create_backend("process", _served(tmp_path / "store"), layers=BARE)
    pid = _pid(backend)
    freeze(pid)
    try:
        backend.close()
        assert _gone(pid, within_s=0.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


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


def test_a_pool_registered_while_no_storage_process_serves_is_registered_by_the_next(
    tmp_path: Path,
) -> None:
    pool = _pool()
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    written = _page(pool, 0)
    with create_backend("process", _served(tmp_path / "store")) as backend:
        pid = _pid(backend)
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid)
        backend.register_host_pool(pool)  # lost or already replaced: never an error
        _served_again(backend, pid)
        deadline = time.monotonic() + 30.0
        while backend.batch_set_v1(["a"], torch.arange(PAGE)) != [True]:
            assert time.monotonic() < deadline, "the new storage process never took the pool"
            time.sleep(0.05)
        raw.zero_()
        assert backend.batch_get_v1(["a"], torch.arange(PAGE)) == [True]
        assert _page(pool, 0) == written
