"""fsspec over ``file://`` (and s3:// for batches): what the file backend promises (issue 48).

Only a regular file is a value: a FIFO, a directory, a socket or a symlink to one (or to
nothing) at a key's path is a miss that never waits, never a stored key, and a write of the key
replaces it. In a batch read one key that cannot be read costs that key, not the batch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.fsspec.backend import FsspecBackend
from hicache_storage.errors import BackendIOError

from ...helpers import make_pool, page_indices
from ..file.test_file_hostile_entries import KINDS, bounded, fifo_of, plant, short_root

__all__ = ["short_root"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_that_is_not_a_file_is_a_miss_never_waited_on_and_never_stored(
    short_root: Path, kind: str
) -> None:
    backend = create_backend("fsspec", {"url": f"file://{short_root}/kv"})
    bare = backend.unwrap()
    assert isinstance(bare, FsspecBackend)
    value = b"g" * 64
    assert backend.set("good", value)
    path = bare.paths.path("bad")
    held = plant(path, kind)
    fifo = fifo_of(path, kind)
    try:
        for target in (bare, backend):
            assert not bounded(lambda t=target: t.exists("bad"), fifo)
            assert bounded(lambda t=target: t.batch_exists(["bad", "good"]), fifo) == 0
            assert bounded(lambda t=target: t.get("bad"), fifo) is None
            assert bounded(lambda t=target: t.get("bad", bytearray(64)), fifo) is None
            outs = [bytearray(64), bytearray(64)]
            batch = bounded(lambda t=target, o=outs: t.batch_get(["bad", "good"], o), fifo)
            assert batch == [False, True] and outs[1] == value
        pool = make_pool("mla", "page_first", pages=2)
        backend.register_host_pool(pool)
        assert bounded(lambda: backend.batch_get_v1(["bad"], page_indices(pool, [0])), fifo) == [
            False
        ]
        # The value takes the entry's place, one key at a time and in a batch.
        assert backend.set("bad", b"v" * 64)
        assert backend.get("bad") == b"v" * 64
        assert os.path.isfile(path) and not os.path.islink(path)
        held += plant(bare.paths.path("bad2"), kind)
        assert backend.batch_set(["bad2", "new"], [b"w" * 64, b"n" * 64]) == [True, True]
        assert backend.get("bad2") == b"w" * 64
    finally:
        for sock in held:
            sock.close()
        backend.close()


def test_a_directory_at_a_keys_path_is_not_deleted_as_a_value(short_root: Path) -> None:
    with create_backend("fsspec", {"url": f"file://{short_root}/kv"}) as backend:
        bare = backend.unwrap()
        assert isinstance(bare, FsspecBackend)
        plant(bare.paths.path("d"), "directory")
        assert backend.delete("d") is False


def test_an_s3_batch_keeps_the_keys_read_beside_one_that_failed(
    s3_url_options: dict[str, Any],
) -> None:
    backend = create_backend("fsspec", s3_url_options)
    bare = backend.unwrap()
    assert isinstance(bare, FsspecBackend)
    try:
        assert backend.batch_set(["a", "b", "c"], [b"1111", b"2222", b"3333"]) == [True] * 3
        outs = [bytearray(4) for _ in range(3)]
        with bare.medium_faults.armed("io", ops={"read"}, times=1):
            assert bare.batch_get(["a", "b", "c"], outs) == [False, True, True]
        assert outs == [b"\x00" * 4, b"2222", b"3333"]
        with bare.medium_faults.armed("io", ops={"read"}), pytest.raises(BackendIOError):
            bare.batch_get(["a", "b"], [bytearray(4), bytearray(4)])
    finally:
        backend.close()
