"""Faults across processes: a writer killed mid-write, a metadata service killed, hung, restarted.

The killed writer is a real child process writing a large value through the public API with
``fsync="before_commit"``; the parent watches the metadata service and SIGKILLs the child while
the key is reserved but not committed, i.e. while its bytes are being written.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hicache_storage import LayerConfig, create_backend
from hicache_storage.backends.threefs import ThreeFSBackend, ThreeFSConfig
from hicache_storage.backends.threefs.metadata import Geometry
from hicache_storage.backends.threefs.metadata_http import HttpMetadata
from hicache_storage.errors import BackendTimeoutError, BackendUnavailableError
from hicache_storage.kit.services import LocalService, freeze

from .conftest import GEOMETRY, LEASE_S, TIMEOUT_S, service_options

MiB = 1 << 20

WRITER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from hicache_storage import create_backend

    options, key, size = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    value = np.full(size, 7, dtype=np.uint8)
    backend = create_backend("3fs", options)
    print("ready", flush=True)
    sys.stdin.readline()
    print(backend.set(key, value), flush=True)
    """
)


def wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def killed_mid_write(options: dict[str, Any], meta: HttpMetadata, key: str, size: int) -> bool:
    """Start a writer of ``key``; SIGKILL it once the key is reserved. Return whether it was."""
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, msgspec.json.encode(options).decode(), key, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        ns = options["file_prefix"]
        while child.poll() is None:
            if meta.states(ns, [key]) == ["reserved"]:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(30)
                return meta.states(ns, [key]) == ["reserved"]
        return False  # the write finished before it could be caught
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


def test_writer_killed_mid_write_is_never_read(
    tmp_path: Path, shared_service: LocalService
) -> None:
    size = 96 * MiB
    options = service_options(
        shared_service,
        tmp_path,
        file_prefix="killed",
        file_size=128 * MiB,
        file_count=1,
        slot_bytes=MiB,
        fsync="before_commit",
    )
    url, token = options["metadata_url"], options["metadata_token"]
    meta = HttpMetadata(url, token=token, timeout_s=5.0)
    try:
        caught = ""
        for attempt in range(5):
            key = f"victim{attempt}"
            if killed_mid_write(options, meta, key, size):
                caught = key
                break
        assert caught, "the writer finished every time before it could be killed mid-write"
        with create_backend("3fs", options) as reader:
            assert reader.exists(caught) is False
            assert reader.get(caught) is None
            assert reader.get(caught, bytearray(size)) is None
            assert reader.batch_exists([caught]) == 0
            # The dead writer's lease runs out; then its slots and the key are free again.
            wait_for(lambda: meta.states("killed", [caught]) == ["absent"], 10 * LEASE_S, "lease")
            value = os.urandom(size)
            assert reader.set(caught, value)
            got = reader.get(caught)
            assert got is not None
            assert hashlib.sha256(got).digest() == hashlib.sha256(value).digest()
            reader.clear()
    finally:
        meta.close()


NO_HEALTH = LayerConfig(health=None)


def bare(options: dict[str, Any]) -> ThreeFSBackend:
    return ThreeFSBackend(msgspec.convert(options, ThreeFSConfig))


def test_killed_service_fails_fast_then_recovers(
    tmp_path: Path, private_service: LocalService
) -> None:
    options = {"path": str(tmp_path / "kv"), **GEOMETRY, **private_service.options}
    backend = bare({**options, "timeout_s": TIMEOUT_S})
    # without health: every call here reaches the service (tests/test_health.py has the rest)
    layered = create_backend("3fs", {**options, "timeout_s": TIMEOUT_S}, layers=NO_HEALTH)
    try:
        assert backend.set("before", b"stored before the kill")
        pid = private_service.state.processes[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not private_service.running(), 10, "the service to die")
        for call in (
            lambda: backend.get("before"),
            lambda: backend.set("during", b"x"),
            lambda: backend.batch_exists(["before"]),
        ):
            with pytest.raises(BackendUnavailableError):
                call()
        assert layered.get("before") is None and layered.set("during", b"x") is False
        assert layered.stats()["degraded"]["total"] == 2
        private_service.start()  # without a snapshot: a new epoch, every key forgotten
        assert backend.get("before") is None
        assert backend.set("after", b"stored after the restart")
        assert bytes(layered.get("after")) == b"stored after the restart"  # type: ignore[arg-type]
    finally:
        backend.close()
        layered.close()


def test_hung_service_times_out(tmp_path: Path, private_service: LocalService) -> None:
    options = {"path": str(tmp_path / "kv"), **GEOMETRY, **private_service.options}
    backend = bare({**options, "timeout_s": 0.5})
    pid = private_service.state.processes[0].pid
    assert pid is not None
    try:
        assert backend.set("k", b"v")
        freeze(pid)
        try:
            with pytest.raises(BackendTimeoutError):
                backend.get("k")
            with pytest.raises((BackendTimeoutError, BackendUnavailableError)):
                backend.set("other", b"v")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert backend.exists("k")
    finally:
        backend.close()


def test_persistent_service_keeps_keys_and_reservations_across_a_kill(
    tmp_path: Path, persistent_service: LocalService
) -> None:
    options = {"path": str(tmp_path / "kv"), **GEOMETRY, **persistent_service.options}
    values = {f"k{i}": os.urandom(100_000 + i) for i in range(5)}
    meta = HttpMetadata(options["metadata_url"], timeout_s=5.0)
    geometry = Geometry(
        GEOMETRY["slot_bytes"],
        GEOMETRY["file_size"] // GEOMETRY["slot_bytes"],
        GEOMETRY["file_count"],
    )
    try:
        with create_backend("3fs", options) as backend:
            assert backend.batch_set(list(values), list(values.values())) == [True] * 5
            assert backend.delete("k4")
        epoch = meta.open("hicache", geometry)
        pending = meta.reserve("hicache", geometry, [("in-flight", 300_000)]).grants[0]
        assert pending.status == "reserved"

        pid = persistent_service.state.processes[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # no chance to write a final snapshot: the journal has it
        wait_for(lambda: not persistent_service.running(), 10, "the service to die")
        persistent_service.start()

        assert meta.open("hicache", geometry) == epoch
        assert meta.states("hicache", ["in-flight"]) == ["reserved"]
        with create_backend("3fs", options) as backend:
            for key, value in values.items():
                got = backend.get(key)
                assert (got is None) if key == "k4" else (got is not None and bytes(got) == value)
            assert backend.set("new", os.urandom(500_000))
            found = meta.lookup("hicache", ["new", *values]).locations
            taken = [
                s
                for loc in found
                if loc
                for first, n in loc.extents
                for s in range(first, first + n)
            ]
            reserved = {s for first, n in pending.extents for s in range(first, first + n)}
            assert len(taken) == len(set(taken)) and not reserved & set(taken)
            backend.clear()
        assert meta.commit("hicache", epoch, [pending.id]) == [True]  # the writer may finish
    finally:
        meta.close()
