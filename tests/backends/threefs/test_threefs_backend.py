"""3FS backend specifics: config errors, file locking, namespaces, MLA single writer, baseline."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backends.threefs import ThreeFSBackend, ThreeFSConfig
from hicache_storage.backends.threefs import backend as threefs_backend
from hicache_storage.backends.threefs.baseline import RawFileBaseline
from hicache_storage.backends.threefs.io import PosixIO, SlotIO
from hicache_storage.backends.threefs.provision import metadata_service
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
)
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kit.integrity import seal
from hicache_storage.kit.services import LocalService, free_port

from .conftest import GEOMETRY, service_options

SMALL: dict[str, Any] = {"file_size": 1 << 20, "file_count": 2, "slot_bytes": 4096}


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"file_size": 10_000, "slot_bytes": 4096}, "file_size"),
        ({"file_prefix": "../x"}, "file_prefix"),
        ({"slot_bytes": 0}, "slot_bytes"),
        ({"io_threads": True}, "io_threads"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"metadata_url": "redis://x"}, "metadata_url"),
        ({"metadata_token": "t"}, "metadata_token"),
        ({"io_engine": "aio"}, "io_engine"),
        ({"fsync": "always"}, "fsync"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_option_names_the_field(tmp_path: Path, options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        create_backend("3fs", {"path": str(tmp_path), **options})


def test_in_process_metadata_locks_the_files(tmp_path: Path) -> None:
    options = {"path": str(tmp_path), **SMALL}
    first = create_backend("3fs", options)
    with pytest.raises(ConfigError, match="metadata_url"):
        create_backend("3fs", options)
    other = create_backend("3fs", {**options, "file_prefix": "other"})  # other files: fine
    other.close()
    first.close()
    again = create_backend("3fs", options)  # the lock went with the first instance
    assert again.get("k") is None  # in-process metadata does not outlive its instance
    again.close()


def test_value_over_capacity_refused(tmp_path: Path) -> None:
    with create_backend("3fs", {"path": str(tmp_path), **SMALL}) as backend:
        assert backend.capabilities.max_value_size == 2 << 20
        with pytest.raises(BufferSizeError):
            backend.set("big", bytes((2 << 20) + 1))
        assert backend.set("fits", bytes(2 << 20))
        assert backend.set("evicts", b"x") and not backend.exists("fits")


def test_unreachable_service_is_a_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BackendUnavailableError, match="unreachable"):
        create_backend("3fs", {"path": str(tmp_path), **SMALL, "metadata_url": url})


def test_wrong_token_is_a_config_error(tmp_path: Path, shared_service: LocalService) -> None:
    options = service_options(shared_service, tmp_path, file_prefix="token")
    with pytest.raises(ConfigError, match="refused the token"):
        create_backend("3fs", {**options, "metadata_token": "wrong"})
    options.pop("metadata_token")
    with pytest.raises(ConfigError, match="refused the token"):
        create_backend("3fs", options)


def test_namespace_geometry_conflict_refused(tmp_path: Path, shared_service: LocalService) -> None:
    options = service_options(shared_service, tmp_path, file_prefix="geometry")
    with create_backend("3fs", options), pytest.raises(ConfigError, match="slots of"):
        create_backend("3fs", {**options, "slot_bytes": 128 << 10})


def test_clear_leaves_other_namespaces(tmp_path: Path, shared_service: LocalService) -> None:
    a = create_backend("3fs", service_options(shared_service, tmp_path, file_prefix="iso-a"))
    b = create_backend("3fs", service_options(shared_service, tmp_path, file_prefix="iso-b"))
    try:
        assert a.set("k", b"from a") and b.set("k", b"from b")
        a.clear()
        assert a.get("k") is None and bytes(b.get("k")) == b"from b"  # type: ignore[arg-type]
        assert sorted(p for p in os.listdir(tmp_path) if p.startswith("iso")) == [
            "iso-a.0.bin",
            "iso-a.1.bin",
            "iso-b.0.bin",
            "iso-b.1.bin",
        ]
    finally:
        b.clear()
        a.close()
        b.close()


def rank(service: LocalService, root: Path, **deployment: Any) -> ThreeFSBackend:
    options = service_options(service, root, file_prefix="ranks", ownership="rank")
    config = ThreeFSConfig(**options)
    return ThreeFSBackend(config, Deployment(**deployment))


def test_rank_ownership_gives_each_rank_its_namespace(
    tmp_path: Path, shared_service: LocalService
) -> None:
    tp0 = rank(shared_service, tmp_path, tp_rank=0, tp_size=2)
    tp1 = rank(shared_service, tmp_path, tp_rank=1, tp_size=2)
    try:
        assert (tp0.namespace, tp1.namespace) == ("ranks.tp0of2", "ranks.tp1of2")
        assert tp0.set("k", b"rank 0") and tp1.set("k", b"rank 1")
        tp1.clear()
        assert tp1.get("k") is None and bytes(tp0.get("k")) == b"rank 0"  # type: ignore[arg-type]
        assert os.path.exists(tmp_path / "ranks.tp1of2.0.bin")
    finally:
        tp0.clear()
        tp0.close()
        tp1.close()


def test_mla_ranks_share_one_copy_written_by_rank_zero(
    tmp_path: Path, shared_service: LocalService
) -> None:
    mla = {"is_mla": True, "tp_size": 2, "pp_size": 2, "pp_rank": 1}
    writer = rank(shared_service, tmp_path, tp_rank=0, **mla)
    reader = rank(shared_service, tmp_path, tp_rank=1, **mla)
    try:
        assert writer.namespace == reader.namespace == "ranks.pp1of2"
        assert reader.set("page", b"from the reader") is False  # absent: a reader never writes
        assert reader.exists("page") is False and reader.stats()["skipped_writes"] == 1
        assert writer.set("page", b"from rank 0")
        assert reader.set("page", b"from the reader") is True  # present: it holds a value
        assert bytes(reader.get("page")) == b"from rank 0"  # type: ignore[arg-type]
    finally:
        writer.clear()
        writer.close()
        reader.close()


def test_mla_with_in_process_metadata_refused(tmp_path: Path) -> None:
    config = ThreeFSConfig(path=str(tmp_path), **SMALL)
    with pytest.raises(ConfigError, match="metadata_url"):
        ThreeFSBackend(config, Deployment(is_mla=True, tp_size=2, tp_rank=1))


def _v1_round_trip(tmp_path: Path) -> None:
    """Store six pages of a host pool in one batch, read them into six other slots, compare."""
    options = {"path": str(tmp_path), **SMALL, "io_threads": 4}
    pool = MHAHostPool(48, 4, 1, 1, 256, dtype=torch.uint8, layout="page_first", pin_memory=False)
    pool.kv_buffer.random_(0, 255)
    with create_backend("3fs", options) as backend:
        backend.register_host_pool(pool)
        keys = [f"p{i}" for i in range(6)]
        assert backend.batch_set_v1(keys, torch.arange(0, 24)) == [True] * 6
        assert backend.batch_get_v1(keys, torch.arange(24, 48)) == [True] * 6
        assert torch.equal(pool.kv_buffer[:, 24:48], pool.kv_buffer[:, :24])


def test_posix_writes_checksum_pages_as_they_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On POSIX I/O a value's record comes from the CRC32C taken while it was written: no
    pass over the page before the write, and the record still proves the bytes on read."""

    def no_seal(*args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("a page was checksummed before its write")

    monkeypatch.setattr(threefs_backend, "seal", no_seal)
    _v1_round_trip(tmp_path)


def test_a_batch_seals_its_pages_at_once_where_the_io_cannot_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the I/O cannot checksum as it writes (usrbio), the integrity records are computed
    on several threads before the write, not one page after another."""
    lock = threading.Lock()
    inside, most = 0, 0

    def slow_seal(*args: Any, **kwargs: Any) -> bytes:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.02)
        with lock:
            inside -= 1
        return seal(*args, **kwargs)

    monkeypatch.setattr(threefs_backend, "seal", slow_seal)
    monkeypatch.setattr(PosixIO, "write_checked", SlotIO.write_checked)
    _v1_round_trip(tmp_path)
    assert 1 < most <= 4, f"{most} seals at once with 4 io_threads"


def test_baseline_uses_the_data_file_and_gives_its_region_back(tmp_path: Path) -> None:
    config = ThreeFSConfig(path=str(tmp_path), **SMALL, io_threads=2)
    with create_backend("3fs", msgspec.to_builtins(config)) as backend:
        assert backend.set("k", b"kept")
        baseline = RawFileBaseline(config, Deployment())
        values = [memoryview(bytes([i]) * 10_000) for i in range(5)]
        baseline.batch_write([f"n{i}" for i in range(5)], values)
        assert os.path.getsize(tmp_path / "hicache.0.bin") > config.stored_file_size
        outs = [memoryview(bytearray(10_000)) for _ in range(5)]
        baseline.batch_read([f"n{i}" for i in range(5)], outs)
        assert [bytes(o) for o in outs] == [bytes(v) for v in values]
        baseline.close()
        assert os.path.getsize(tmp_path / "hicache.0.bin") == config.stored_file_size
        assert bytes(backend.get("k")) == b"kept"  # type: ignore[arg-type]


def test_provisioned_service_serves_the_documented_geometry(tmp_path: Path) -> None:
    service = metadata_service(tmp_path / "svc", lease_s=1.0)
    assert service.options == {"metadata_url": service.options["metadata_url"]}
    with service:
        options = {"path": str(tmp_path / "kv"), **GEOMETRY, **service.options}
        with create_backend("3fs", options) as backend:
            assert backend.set("k", b"v") and backend.stats()["max_bytes"] == 64 << 20
    assert not service.running()
