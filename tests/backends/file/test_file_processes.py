"""The file backend across processes: a writer killed mid-write, and racing writers."""

from __future__ import annotations

import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hicache_storage.backends.file import FileBackend, FileConfig
from hicache_storage.config import Deployment
from hicache_storage.kit import NATIVE_CHECKED_READS
from hicache_storage.kit.integrity import RECORD_BYTES

# On the Python path (os.pwritev, patched) writes are slowed down and cut into 256 KiB pieces, so
# a kill lands in the middle of one; the native checked writes run at full speed, and a kill lands
# wherever it lands. The racing writers take the Python path to make their races likely.
KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from hicache_storage.backends.file import FileBackend, FileConfig
    from hicache_storage.config import Deployment
    from hicache_storage.kit import pageio

    if sys.argv[3] == "python":
        pageio._CHECKED = None
        real = os.pwritev
        def slow(fd, buffers, offset):
            time.sleep(0.002)
            return real(fd, [memoryview(buffers[0]).cast("B")[: 1 << 18]], offset)
        os.pwritev = slow

    backend = FileBackend(FileConfig(root=sys.argv[1]), Deployment())
    size = int(sys.argv[2])
    for i in range(1000):
        backend.set(f"k{i}", np.full(size, i % 251, dtype=np.uint8))
        print(i, flush=True)
    """
)

RACING_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from hicache_storage.backends.file import FileBackend, FileConfig
    from hicache_storage.config import Deployment
    from hicache_storage.kit import pageio

    pageio._CHECKED = None
    real = os.pwritev
    def chunked(fd, buffers, offset):
        return real(fd, [memoryview(buffers[0]).cast("B")[: 1 << 16]], offset)
    os.pwritev = chunked

    root, go = sys.argv[1], sys.argv[5]
    fill, count, size = (int(arg) for arg in sys.argv[2:5])
    backend = FileBackend(FileConfig(root=root), Deployment())
    value = np.full(size, fill, dtype=np.uint8)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    results = [backend.set(f"k{i}", value) for i in range(count)]
    print("ok" if all(results) else "failed", flush=True)
    """
)


def temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp.*") if p.is_file()]


@pytest.mark.parametrize("path", ["python", "native"])
def test_killed_writer_leaves_no_partial_object(tmp_path: Path, path: str) -> None:
    if path == "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the checked-I/O helper is built for x86-64 only")
    assert path == "python" or NATIVE_CHECKED_READS, "the checked-I/O helper did not build"
    size = 16 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(size), path],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "0"  # one complete value is published
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until a write is under way
            if any(p.stat().st_size > 0 for p in temps(tmp_path) if p.exists()):
                break
            time.sleep(0.005)
        else:
            raise AssertionError("the writer never started a second value")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    left = temps(tmp_path)
    if path == "python":
        assert left, "the kill should have left a temporary file behind"
        assert all(p.stat().st_size < size for p in left)
    assert all(p.stat().st_size < size + RECORD_BYTES for p in left)  # never a whole object
    with FileBackend(FileConfig(root=str(tmp_path)), Deployment()) as backend:
        complete = 0
        for i in range(1000):
            key = f"k{i}"
            if not backend.exists(key):
                assert backend.get(key) is None
                assert backend.get(key, bytearray(size)) is None
                continue
            out = np.empty(size, dtype=np.uint8)
            assert backend.get(key, out) is out
            assert (out == i % 251).all()
            complete += 1
        assert complete >= 1
        assert backend.stats()["objects"] == complete
        assert backend.stats()["bytes"] == complete * (size + RECORD_BYTES)
    assert temps(tmp_path) == left  # young temps survive a scan ...
    with FileBackend(FileConfig(root=str(tmp_path), stale_temp_s=0.0), Deployment()):
        pass
    assert temps(tmp_path) == []  # ... stale ones do not


def test_racing_processes_leave_one_complete_value_per_key(tmp_path: Path) -> None:
    count, size = 40, 1 << 20
    root, go = tmp_path / "store", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RACING_WRITER,
                str(root),
                str(fill),
                str(count),
                str(size),
                str(go),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for fill in (0x11, 0xEE)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        go.touch()
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert out.strip() == "ok"
            assert proc.returncode == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    with FileBackend(FileConfig(root=str(root)), Deployment()) as backend:
        assert backend.batch_exists([f"k{i}" for i in range(count)]) == count
        for i in range(count):
            value = np.frombuffer(backend.get(f"k{i}") or b"", dtype=np.uint8)
            assert value.size == size
            assert set(np.unique(value).tolist()) in ({0x11}, {0xEE})
        assert backend.stats()["objects"] == count
    assert temps(root) == []
