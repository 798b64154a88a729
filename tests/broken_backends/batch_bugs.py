"""Batch reads that answer the leading run right and get a slot after it, or a miss's slot, wrong.

An engine uses only the leading run of hits of a batch, so these bugs are the optimisations an
author might make for what comes after it, or for misses: clearing the buffers of misses,
reading pages after the first miss before checking sizes, answering the rest from metadata.
Each starts from the correct one-file-per-key backend (:class:`.reference.FilePerKey`); a check
that looks only at the leading run, or only at the slots of hits, passes every one of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from typing_extensions import Buffer

from hicache_storage.kit import closed_guard, flat, nbytes

from . import REFERENCE, Bug, bug
from .reference import FilePerKey

if TYPE_CHECKING:
    import torch

__all__ = ["BUGS", "ClearsMissBuffers", "ReadsBeforeSizeCheckAfterMiss", "RestByExistence"]


@closed_guard
class ClearsMissBuffers(FilePerKey):
    """Bug: ``batch_get`` zero-fills the buffer of every absent key.

    Meant so that a caller never mistakes stale bytes for a value; but a miss must leave its
    buffer untouched (the caller may hold other data there).
    """

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        found = []
        for key, out in zip(keys, outs, strict=True):
            view = flat(memoryview(out))
            got = self._read(key, [view], strict=False)
            if got is None:
                view[:] = bytes(view.nbytes)
            found.append(bool(got))
        return found


@closed_guard
class ReadsBeforeSizeCheckAfterMiss(FilePerKey):
    """Bug: past the first miss, ``batch_get_v1`` reads an object into its page, then sizes it.

    The leading run is read as it should be. What follows it, which the engine does not load,
    is read optimistically, one ``preadv`` a page with the size compared once it returned: an
    object of another size after the first miss is answered as a miss, and its bytes are left
    in the page, a host slot that may hold another request's KV.
    """

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        found: list[bool] = []
        for key, views in zip(keys, self.page_views(keys, host_indices), strict=True):
            buffers = [flat(view) for view in views]
            if all(found):
                found.append(bool(self._read(key, buffers, strict=False)))
            else:
                found.append(self._read_then_check(key, buffers))
        return found

    def _read_then_check(self, key: str, buffers: list[memoryview]) -> bool:
        fd = self._open(key)
        if fd is None:
            return False
        try:
            with self.errors.guard(f"read {key!r}"):
                size = os.fstat(fd).st_size
                done = os.preadv(fd, buffers, 0)
                return size == nbytes(buffers) == done
        finally:
            os.close(fd)


@closed_guard
class RestByExistence(FilePerKey):
    """Bug: past the first miss, ``batch_get_v1`` answers from metadata, reading nothing.

    The engine loads only the leading run, so the author skipped the reads after the first
    miss and reported whether each key exists: a stored page after a miss is a hit whose page
    was never filled.
    """

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        found: list[bool] = []
        for key, views in zip(keys, self.page_views(keys, host_indices), strict=True):
            if all(found):
                found.append(bool(self._read(key, [flat(v) for v in views], strict=False)))
            else:
                found.append(self.exists(key))
        return found


_M = __name__


def _file_bug(name: str, cls: str, description: str, caught_by: str) -> Bug:
    caps = REFERENCE.capabilities
    return bug(
        name, f"{_M}:{cls}", description, caught_by, config=REFERENCE.config, capabilities=caps
    )


BUGS: list[Bug] = [
    _file_bug(
        "broken-clears-miss-buffers",
        "ClearsMissBuffers",
        "batch_get zero-fills the buffer of every absent key",
        "TestBatch::test_batch_get_per_key_hit_miss",
    ),
    _file_bug(
        "broken-v1-reads-then-sizes",
        "ReadsBeforeSizeCheckAfterMiss",
        "past the first miss, batch_get_v1 reads an object into its page, then checks its size",
        "TestZeroCopy::test_v1_hits_and_misses_every_page",
    ),
    _file_bug(
        "broken-v1-rest-by-exists",
        "RestByExistence",
        "past the first miss, batch_get_v1 answers whether each key exists and reads nothing",
        "TestZeroCopy::test_v1_hits_and_misses_every_page",
    ),
]
