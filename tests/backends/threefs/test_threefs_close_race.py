"""``close()`` under a running read: the descriptors outlive every batch.

Before, :meth:`SlotIO.close` closed the data files under a running ``preadv`` (a recycled
descriptor could then be read or written) and a batch that came after found an empty list
(``IndexError``); the backend closed its I/O engine under calls in flight.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.threefs.io import IORequest, PosixIO
from hicache_storage.conformance.checks.close_race import KEYS, _Race
from hicache_storage.errors import BackendClosedError
from hicache_storage.layers import ForwardingBackend

from .conftest import GEOMETRY

FILE = 1 << 16
WAIT_S = 10.0


class _SlowIO(PosixIO):
    """POSIX I/O whose reads wait, once inside, until the test lets them go on."""

    def __init__(self, paths: Sequence[str]) -> None:
        super().__init__(paths, FILE, 1)
        self.inside = threading.Event()
        self.proceed = threading.Event()

    def _read_batch(self, requests: Sequence[IORequest]) -> None:
        self.inside.set()
        self.proceed.wait(WAIT_S)
        super()._read_batch(requests)


def test_close_under_a_running_read_keeps_the_files_until_it_ends(tmp_path: Path) -> None:
    io = _SlowIO([str(tmp_path / "f0.bin")])
    data = os.urandom(4096)
    io.write([IORequest(0, 0, [memoryview(data)])])
    fds = list(io.fds)
    out = bytearray(len(data))
    errors: list[BaseException] = []

    def read() -> None:
        try:
            io.read([IORequest(0, 0, [memoryview(out)])])
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert io.inside.wait(WAIT_S)
    closer = threading.Thread(target=io.close)
    closer.start()
    closer.join(0.05)
    assert io.fds == fds and all(os.fstat(fd) for fd in fds), "files closed under a read"
    with pytest.raises(BackendClosedError):
        io.write([IORequest(0, 0, [memoryview(data)])])
    io.proceed.set()
    reader.join(WAIT_S)
    closer.join(WAIT_S)
    assert errors == [] and bytes(out) == data
    assert io.fds == []
    with pytest.raises(BackendClosedError):
        io.read([IORequest(0, 0, [memoryview(out)])])
    with pytest.raises(BackendClosedError):
        io.sync([0])


@pytest.mark.parametrize("stack", ["bare", "layered"])
def test_backend_closed_under_load_answers_or_raises_closed(tmp_path: Path, stack: str) -> None:
    for seed in range(3):
        layered = create_backend("3fs", {"path": str(tmp_path / f"s{seed}"), **GEOMETRY})
        instance = layered
        if stack == "bare" and isinstance(layered, ForwardingBackend):
            instance = layered.unwrap()
        race = _Race(instance, [f"k{seed}-{i}" for i in range(KEYS)], seed=seed)
        race.prepare()
        assert race.run(layered.close) == []
