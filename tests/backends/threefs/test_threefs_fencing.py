"""Never another key's bytes: late writers, wiped or foreign data directories (issue 14, items 1-2).

The metadata service hands a slot to another key once a writer's lease ran out, and nothing can
stop that writer's late bytes from landing in it. The integrity record makes them a miss. These
tests drive the real service process and real writer processes, paused with SIGSTOP by PID.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.threefs.backend import generation_of
from hicache_storage.backends.threefs.provision import metadata_service
from hicache_storage.kit.integrity import RECORD_BYTES, seal
from hicache_storage.kit.services import LocalService, freeze

SLOT = 64 << 10
# 24 slots: writers of 96 distinct keys keep every slot changing hands.
SMALL: dict[str, Any] = {"file_size": 12 * SLOT, "file_count": 2, "slot_bytes": SLOT}
LEASE_S = 0.5


def _value(key: str) -> bytes:
    """The one value of ``key``: its digest repeated to a slot (content-addressed, like KV)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (SLOT // len(seed) + 1))[:SLOT]


def _writer(options: dict[str, Any], keys: list[str], stop: Any, seed: int) -> None:
    rng = random.Random(seed)
    with create_backend("3fs", options) as backend:
        while not stop.is_set():
            batch = rng.sample(keys, 4)
            backend.batch_set(batch, [_value(key) for key in batch])
            if rng.random() < 0.3:
                backend.delete(rng.choice(keys))


@pytest.fixture
def fast_lease_service(tmp_path: Path) -> Any:
    service = metadata_service(tmp_path / "metadata", lease_s=LEASE_S, timeout_s=2.0)
    with service:
        yield service


def _options(service: LocalService, root: Path, **extra: Any) -> dict[str, Any]:
    return {"path": str(root), **SMALL, **service.options, "timeout_s": 2.0, **extra}


def test_writers_paused_past_their_lease_never_give_wrong_bytes(
    tmp_path: Path, fast_lease_service: LocalService
) -> None:
    options = _options(fast_lease_service, tmp_path / "kv", io_threads=1)
    keys = [f"k{i}" for i in range(96)]
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    # Until enough pauses and reads have happened, however slowly the writers start here.
    give_up_at = time.time() + 60.0
    writers = [
        context.Process(target=_writer, args=(options, keys, stop, seed)) for seed in range(3)
    ]
    for process in writers:
        process.start()
    rng = random.Random(7)
    reads = hits = wrong = pauses = 0
    try:
        with create_backend("3fs", options) as reader:
            next_pause = time.time() + 1.0
            while time.time() < give_up_at and (pauses < 10 or reads <= 200 or hits <= 20):
                if time.time() >= next_pause:
                    victim = writers[pauses % len(writers)]
                    assert victim.pid is not None
                    freeze(victim.pid)
                    time.sleep(LEASE_S * 1.6)
                    os.kill(victim.pid, signal.SIGCONT)
                    pauses += 1
                    next_pause = time.time() + rng.uniform(0.05, 0.4)
                key = rng.choice(keys)
                got = reader.get(key)
                reads += 1
                if got is not None:
                    hits += 1
                    wrong += bytes(got) != _value(key)
            stats = reader.stats()
    finally:
        stop.set()
        for process in writers:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert pauses >= 10 and reads > 200 and hits > 20, (pauses, reads, hits)
    assert wrong == 0, f"{wrong} wrong hits in {hits} hits of {reads} reads; stats {stats}"


def test_late_write_into_a_reassigned_slot_is_a_miss(
    tmp_path: Path, fast_lease_service: LocalService
) -> None:
    """The mechanism, step by step: reserve, outlive the lease, write after the slot moved."""
    one_slot = {"file_size": SLOT, "file_count": 1, "slot_bytes": SLOT}
    options = {**_options(fast_lease_service, tmp_path / "kv"), **one_slot}
    with create_backend("3fs", options) as late, create_backend("3fs", options) as other:
        bare = late.unwrap()  # type: ignore[attr-defined]
        meta = bare._meta
        granted = meta.reserve(bare.namespace, bare.geometry, [("first", SLOT)])
        assert granted.grants[0].status == "reserved"
        time.sleep(LEASE_S * 1.5)
        assert other.set("second", _value("second"))  # the one slot, taken over
        where = other.unwrap().locate("second", 0)  # type: ignore[attr-defined]
        assert where is not None
        path, position = where
        generation = generation_of(granted.epoch, granted.grants[0].id)
        record = seal("first", [_value("first")], generation=generation)
        with open(path, "r+b") as data:  # the stalled writer's late bytes land, record and all
            data.seek(position)
            data.write(_value("first"))
            data.seek(SLOT + position // SLOT * RECORD_BYTES)
            data.write(record)
        assert other.get("second") is None
        assert other.batch_get(["second"], [bytearray(SLOT)]) == [False]
        assert not other.exists("second"), "a key that failed verification stayed mapped"
        assert other.stats()["integrity_other_key"] == 1


@pytest.mark.parametrize("how", ["wiped", "second_path"])
def test_data_not_in_this_directory_is_a_miss(
    tmp_path: Path, fast_lease_service: LocalService, how: str
) -> None:
    first = tmp_path / "kv"
    with create_backend("3fs", _options(fast_lease_service, first)) as backend:
        keys = [f"k{i}" for i in range(8)]
        assert backend.batch_set(keys, [_value(key) for key in keys]) == [True] * 8
    if how == "wiped":
        shutil.rmtree(first)
        root = first
    else:
        root = tmp_path / "elsewhere"
    with create_backend("3fs", _options(fast_lease_service, root)) as backend:
        assert backend.batch_exists(keys) >= 0
        outs = [bytearray(SLOT) for _ in keys]
        assert backend.batch_get(keys, outs) == [False] * 8, "zeros were returned as a hit"
        assert all(backend.get(key) is None for key in keys)
        failures = {k: v for k, v in backend.stats().items() if k.startswith("integrity_")}
        assert sum(v for v in failures.values() if isinstance(v, int)) >= 8, failures
