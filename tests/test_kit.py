"""The author's kit does what backends rely on it for."""

from __future__ import annotations

import errno
import io
import os
import threading
from pathlib import Path

import pytest

from hicache_storage import (
    BackendClosedError,
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    StorageBackend,
)
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.keys.validation import MAX_KEY_LENGTH
from hicache_storage.kit import (
    GUARDED,
    IOV_MAX,
    AtomicFiles,
    Deadline,
    ErrorMap,
    FanoutPaths,
    MediumFaults,
    Verdict,
    bounded,
    closed_guard,
    current_deadline,
    is_missing,
    is_temp,
    read_exact,
    readinto_views,
    temp_name,
    write_from,
    write_views,
)


class ClientDown(Exception):
    """A client library's own "cannot connect"."""


@pytest.mark.parametrize(
    ("raised", "typed"),
    [
        (ClientDown("no route"), BackendUnavailableError),
        (TimeoutError("slow"), BackendTimeoutError),
        (OSError(errno.ETIMEDOUT, "timed out"), BackendTimeoutError),
        (ConnectionResetError("reset"), BackendUnavailableError),
        (OSError(errno.ENOTCONN, "not connected"), BackendUnavailableError),
        (OSError(errno.ESTALE, "stale handle"), BackendUnavailableError),
        (OSError(errno.EIO, "i/o"), BackendIOError),
        (PermissionError(errno.EACCES, "denied"), BackendIOError),
        (ValueError("odd answer"), BackendError),
    ],
)
def test_error_map_types_each_failure(raised: Exception, typed: type[BackendError]) -> None:
    errors = ErrorMap("store", [(ClientDown, BackendUnavailableError)])
    with pytest.raises(typed) as info, errors.guard("read 'k'"):
        raise raised
    assert type(info.value) is typed
    assert "store could not read 'k': " in str(info.value)
    assert info.value.__cause__ is raised


def test_error_map_keeps_typed_errors_and_errno_and_masks_secrets() -> None:
    errors = ErrorMap("store")
    typed = BackendUnavailableError("down")
    assert errors.translate(typed, "x") is typed
    io_error = errors.translate(OSError(errno.ENOSPC, "No space left on device"), "write 'k'")
    assert isinstance(io_error, BackendIOError) and io_error.errno == errno.ENOSPC
    leaked = errors.translate(ValueError("redis://user:hunter22secret@host failed"), "connect")
    assert "hunter22secret" not in str(leaked)
    with pytest.raises(KeyboardInterrupt), errors.guard("x"):
        raise KeyboardInterrupt


class _StoreErrors(ErrorMap):
    """A client whose replies carry a code the exception class does not."""

    def describe(self, exc: BaseException, what: str) -> Verdict | None:
        if str(exc).startswith("NOAUTH"):
            return Verdict(BackendUnavailableError, f"store refused {what}: {exc}", "auth", False)
        return None


def test_error_map_describe_counts_scrubs_and_lets_bugs_through() -> None:
    counted: list[str] = []
    errors = _StoreErrors(
        "store",
        [(ClientDown, BackendUnavailableError)],
        secrets={"s3cr3t-token"},
        catch=ClientDown,
        count=counted.append,
    )
    cause = OSError("socket said s3cr3t-token")
    with pytest.raises(BackendUnavailableError) as info, errors.guard("login"):
        try:
            raise cause
        except OSError as exc:
            raise ClientDown("NOAUTH for s3cr3t-token") from exc
    assert str(info.value) == "store refused login: NOAUTH for ***"
    assert info.value.retryable is False
    assert "s3cr3t-token" not in str(info.value.__cause__) and "s3cr3t-token" not in str(cause)
    with pytest.raises(BackendUnavailableError), errors.guard("read 'k'"):
        raise ClientDown("down")  # no verdict: the rules apply, counted by class name
    other: list[str] = []
    with pytest.raises(BackendUnavailableError), errors.guard("read 'k'", other.append):
        raise ClientDown("down")
    assert counted == ["auth", "ClientDown"] and other == ["ClientDown"]
    with pytest.raises(KeyError), errors.guard("read 'k'"):  # outside catch: a bug, untouched
        raise KeyError("k")
    assert counted == ["auth", "ClientDown"]


def test_deadline_bounds_the_thread_and_nests_to_the_sooner_end() -> None:
    assert current_deadline() is None and bounded(3.0) == 3.0 and bounded(None) is None
    outer = Deadline(5.0)
    assert outer.live() and outer.allows(4.0) and not outer.allows(6.0)
    with outer.applied():
        assert current_deadline() is outer
        assert bounded(None) == pytest.approx(5.0, abs=0.5) and bounded(1.0) == 1.0
        with Deadline(60.0).applied() as later:  # an inner call never outlives its caller
            assert current_deadline() is outer and later.left() > 50
        with Deadline(0.5).applied() as sooner:
            assert current_deadline() is sooner
        seen: list[Deadline | None] = []
        worker = threading.Thread(target=lambda: seen.append(current_deadline()))
        worker.start()
        worker.join()
        assert seen == [None]  # the thread's own, not the process's
        assert current_deadline() is outer
    assert current_deadline() is None
    with Deadline(-1.0).applied() as passed:
        assert not passed.live() and passed.left() < 0
        with pytest.raises(TimeoutError):
            bounded(10.0)
    outer.cancel()
    assert outer.cancelled and not outer.live() and outer.left() > 0


def test_is_missing() -> None:
    assert is_missing(FileNotFoundError()) and is_missing(NotADirectoryError())
    assert not is_missing(PermissionError()) and not is_missing(KeyError())


def test_medium_faults_raise_the_medium_errors_for_armed_ops_only() -> None:
    faults = MediumFaults()
    faults.check("read")  # disarmed: nothing
    with faults.armed("vanished", ops={"read"}):
        faults.check("write")
        with pytest.raises(FileNotFoundError):
            faults.check("read")
    faults.check("read")
    faults.arm("timeout", times=2)
    for _ in range(2):
        with pytest.raises(TimeoutError):
            faults.check("stat")
    faults.check("stat")  # used up
    with pytest.raises(ConfigError, match="unknown medium operations"):
        faults.arm("io", ops={"rename"})
    with pytest.raises(ConfigError, match="no 'io' faults"):
        MediumFaults({"vanished": KeyError}).arm("io")
    with pytest.raises(ConfigError, match="unknown fault kinds"):
        MediumFaults({"flaky": KeyError})


def test_fanout_paths() -> None:
    paths = FanoutPaths("/data/kv/")
    directory = paths.directory("k1")
    assert directory.startswith("/data/kv/") and len(directory.split("/")) == 5
    assert all(FanoutPaths.is_fanout_dir(part) for part in directory.split("/")[-2:])
    assert paths.path("k1") == f"{directory}/k1"
    flat_paths = FanoutPaths("mem://bucket", fanout=False, sep="/")
    assert flat_paths.path("k1") == "mem://bucket/k1"
    temp = paths.temp_path("k1")
    assert os.path.dirname(temp) == directory and is_temp(os.path.basename(temp))
    assert not is_temp("k1") and not is_temp(".hidden")


def test_temp_names_fit_name_max_for_the_longest_key() -> None:
    name = temp_name("k" * MAX_KEY_LENGTH)
    assert len(name.encode()) <= 255 and is_temp(name)
    assert temp_name("k") != temp_name("k")


def test_atomic_files_first_value_wins_and_leave_no_temp(tmp_path: Path) -> None:
    files = AtomicFiles(fsync=True)
    paths = FanoutPaths(str(tmp_path / "root"))
    path = paths.path("k")
    assert files.write(path, [memoryview(b"first")], paths.temp_path("k"))
    assert not files.write(path, [memoryview(b"second")], paths.temp_path("k"))
    assert Path(path).read_bytes() == b"first"
    assert os.listdir(os.path.dirname(path)) == ["k"]


def test_atomic_files_one_winner_among_racing_writers(tmp_path: Path) -> None:
    files = AtomicFiles()
    paths = FanoutPaths(str(tmp_path))
    barrier = threading.Barrier(8)
    won: list[bytes] = []

    def write(value: bytes) -> None:
        barrier.wait()
        if files.write(paths.path("k"), [memoryview(value)], paths.temp_path("k")):
            won.append(value)

    threads = [threading.Thread(target=write, args=(bytes([i]) * 4096,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and Path(paths.path("k")).read_bytes() == won[0]


def test_atomic_files_rebuild_a_removed_directory(tmp_path: Path) -> None:
    files = AtomicFiles()
    paths = FanoutPaths(str(tmp_path / "root"))
    assert files.write(paths.path("a"), [memoryview(b"1")], paths.temp_path("a"))
    os.unlink(paths.path("a"))
    for directory in (paths.directory("a"), os.path.dirname(paths.directory("a"))):
        os.rmdir(directory)
    assert files.write(paths.path("a"), [memoryview(b"2")], paths.temp_path("a"))
    assert Path(paths.path("a")).read_bytes() == b"2"


def test_vectored_io_past_iov_max(tmp_path: Path) -> None:
    n = IOV_MAX * 2 + 3
    data = [bytes([i % 251]) * 3 for i in range(n)]
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        write_from(fd, [memoryview(d) for d in data])
        outs = [bytearray(3) for _ in range(n)]
        assert read_exact(fd, [memoryview(o) for o in outs])
        assert [bytes(o) for o in outs] == data
        assert not read_exact(fd, [memoryview(bytearray(3 * n + 1))])  # the file is shorter
    finally:
        os.close(fd)


class Trickle(io.RawIOBase):
    """A stream that moves at most 5 bytes per call, like a network socket might."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = bytearray(data)
        self.written = bytearray()

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(5, len(buffer), len(self.data))
        buffer[:n] = self.data[:n]
        del self.data[:n]
        return n

    def write(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(5, len(buffer))
        self.written += buffer[:n]
        return n


def test_stream_io_handles_short_transfers() -> None:
    data = bytes(range(64))
    outs = [bytearray(10), bytearray(30), bytearray(24)]
    assert readinto_views(Trickle(data), [memoryview(o) for o in outs]) == 64
    assert b"".join(outs) == data
    assert readinto_views(Trickle(data[:40]), [memoryview(bytearray(64))]) == 40
    sink = Trickle()
    assert write_views(sink, [memoryview(data[:33]), memoryview(data[33:])]) == 64
    assert bytes(sink.written) == data


@closed_guard
class Guarded(MemoryBackend):
    """A backend used bare, guarded by the kit."""


def test_closed_guard_refuses_every_data_call_after_close() -> None:
    backend: StorageBackend = Guarded()
    assert backend.set("k", b"v") and backend.get("k") == b"v"
    backend.close()
    calls = {
        "get": lambda: backend.get("k"),
        "exists": lambda: backend.exists("k"),
        "set": lambda: backend.set("k", b"v"),
        "batch_get": lambda: backend.batch_get(["k"], [bytearray(1)]),
        "batch_set": lambda: backend.batch_set(["k"], [b"v"]),
        "batch_exists": lambda: backend.batch_exists(["k"]),
        "batch_get_v1": lambda: backend.batch_get_v1(["k"], [0]),
        "batch_set_v1": lambda: backend.batch_set_v1(["k"], [0]),
        "register_host_pool": lambda: backend.register_host_pool(object()),  # type: ignore[arg-type]
        "delete": lambda: backend.delete("k"),
        "clear": backend.clear,
    }
    assert set(calls) == set(GUARDED)
    for name, call in calls.items():
        with pytest.raises(BackendClosedError, match="closed"):
            call()
        assert name
    assert backend.stats()["backend"] == "memory"
    backend.close()
