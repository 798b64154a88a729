"""Data-path bugs: sizes, empty values, long keys, buffer sizes, v1 pages, zero-copy claims.

Each backend is the dictionary backend (:class:`.dict_bugs.DictBackend`) or the reference
one-file-per-key backend (:class:`.reference.FilePerKey`) with one realistic bug of the kind
found in real stores: a chunked writer that forgets its last partial chunk, a key shortened to
fit a name limit, a size check that accepts a larger buffer, an RDMA-style read of the stored
length, a single ``preadv`` for a page of more than ``IOV_MAX`` buffers, a fixed bounce buffer.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from typing_extensions import Buffer

from hicache_storage import BufferSizeError, Deployment
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.kit import IOV_MAX, FanoutPaths, flat, nbytes, read_into

from . import REFERENCE, Bug, bug
from .dict_bugs import DictBackend
from .reference import FilePerKey, FilePerKeyConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUGS",
    "AcceptsLargerOut",
    "BatchAcceptsLargerOut",
    "BounceBuffer4MiB",
    "CaseFoldedNames",
    "DropsMiBTail",
    "EmptyFileIsMiss",
    "EmptyIsFalsy",
    "KeepsCallerBuffer",
    "KeysTruncated64",
    "NamesTruncated128",
    "OnePwritevPerPage",
    "ReadsFirstIovMax",
    "SizedByPageNbytes",
    "SpillsLongerObject",
    "StagesThroughBytes",
    "TempNameOverflows",
    "Truncates8MiB",
]

MiB = 1 << 20
_WRITE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)


def _scatter(data: Buffer, views: Sequence[memoryview]) -> None:
    """Copy consecutive slices of ``data`` into ``views`` (as far as ``data`` reaches)."""
    source = as_readable(data)
    offset = 0
    for view in views:
        piece = source[offset : offset + view.nbytes]
        flat(view)[: len(piece)] = piece
        offset += view.nbytes


def _head(views: Sequence[memoryview], size: int) -> list[memoryview]:
    """Return the first ``size`` bytes of ``views`` as views."""
    kept = []
    for view in views:
        if size <= 0:
            break
        piece = flat(view)[:size]
        kept.append(piece)
        size -= piece.nbytes
    return kept


# -- values ------------------------------------------------------------------------------------


class DropsMiBTail(FilePerKey):
    """Bug: writes values in whole 1 MiB chunks and forgets the partial chunk after the last."""

    name = "broken-mib-tail"

    def _store(self, key: str, views: list[memoryview]) -> bool:
        total = nbytes(views)
        return super()._store(key, _head(views, total - total % MiB if total > MiB else total))


class Truncates8MiB(DictBackend):
    """Bug: keeps at most 8 MiB of a value (its largest transfer), a silent truncation."""

    name = "broken-8mib"
    LIMIT: ClassVar[int] = 8 * MiB

    def set(self, key: str, value: Buffer) -> bool:
        return super().set(key, bytes(as_readable(value))[: self.LIMIT])


class EmptyFileIsMiss(FilePerKey):
    """Bug: takes a 0-byte file for the leftover of a failed write, so ``b""`` reads as a miss."""

    name = "broken-empty-file"

    def _open(self, key: str) -> int | None:
        fd = super()._open(key)
        if fd is not None and os.fstat(fd).st_size == 0:
            os.close(fd)
            return None
        return fd


class EmptyIsFalsy(DictBackend):
    """Bug: ``batch_get`` tests the returned buffer's truth, so an empty value is a miss."""

    name = "broken-empty-falsy"

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        results = []
        for key, out in zip(keys, outs, strict=True):
            try:
                results.append(bool(self.get(key, out)))
            except BufferSizeError:
                results.append(False)
        return results


class KeepsCallerBuffer(DictBackend):
    """Bug: ``set`` keeps a view of the caller's buffer instead of a copy."""

    name = "broken-keeps-buffer"

    def set(self, key: str, value: Buffer) -> bool:
        with self._lock:
            self._data.setdefault(key, as_readable(value))  # type: ignore[arg-type]
        return True


# -- keys --------------------------------------------------------------------------------------


class KeysTruncated64(DictBackend):
    """Bug: indexes objects by the first 64 characters of the key (the length of a hash)."""

    name = "broken-key-64"

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        return super().get(key[:64], out)

    def exists(self, key: str) -> bool:
        return super().exists(key[:64])

    def set(self, key: str, value: Buffer) -> bool:
        return super().set(key[:64], value)

    def delete(self, key: str) -> bool:
        return super().delete(key[:64])


class _ShortPaths(FanoutPaths):
    """File names from the key's first 128 characters."""

    def path(self, key: str) -> str:
        return super().path(key[:128])

    def temp_path(self, key: str) -> str:
        return super().temp_path(key[:128])


class NamesTruncated128(FilePerKey):
    """Bug: keeps file names short by cutting keys to 128 characters."""

    name = "broken-name-128"

    def __init__(self, config: FilePerKeyConfig, deployment: Deployment | None = None) -> None:
        super().__init__(config, deployment)
        self.paths = _ShortPaths(self.root)


class _LowerPaths(FanoutPaths):
    """File names in lower case."""

    def path(self, key: str) -> str:
        return super().path(key.lower())

    def temp_path(self, key: str) -> str:
        return super().temp_path(key.lower())


class CaseFoldedNames(FilePerKey):
    """Bug: lower-cases file names (to behave alike on case-insensitive filesystems)."""

    name = "broken-casefold"

    def __init__(self, config: FilePerKeyConfig, deployment: Deployment | None = None) -> None:
        super().__init__(config, deployment)
        self.paths = _LowerPaths(self.root)


class _LongTempPaths(FanoutPaths):
    """Temporary names ``.<key>.tmp-<pid>-<64 hex>``: over NAME_MAX for keys near 200."""

    def temp_path(self, key: str) -> str:
        token = uuid.uuid4().hex + uuid.uuid4().hex
        return f"{self.directory(key)}{self.sep}.{key}.tmp-{os.getpid()}-{token}"


class TempNameOverflows(FilePerKey):
    """Bug: its temporary file names exceed NAME_MAX (255) for keys of 180 characters and more."""

    name = "broken-temp-name"

    def __init__(self, config: FilePerKeyConfig, deployment: Deployment | None = None) -> None:
        super().__init__(config, deployment)
        self.paths = _LongTempPaths(self.root)


# -- output buffers ----------------------------------------------------------------------------


class BatchAcceptsLargerOut(DictBackend):
    """Bug: ``batch_get`` fills the head of a larger buffer and reports a hit."""

    name = "broken-batch-larger-out"

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        results = []
        for key, out in zip(keys, outs, strict=True):
            value, view = self._lookup(key), as_writable(out)
            if value is None or view.nbytes < len(value):
                results.append(False)
                continue
            view[: len(value)] = value
            results.append(True)
        return results


class AcceptsLargerOut(FilePerKey):
    """Bug: the size check refuses only buffers smaller than the object (``<``, not ``!=``)."""

    name = "broken-larger-out"

    def _read(self, key: str, views: list[memoryview], *, strict: bool) -> bool | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            with self.errors.guard(f"read {key!r}"):
                size = os.fstat(fd).st_size
                if size > nbytes(views):
                    if strict:
                        raise BufferSizeError(f"buffer of {nbytes(views)} bytes < {size}")
                    return False
                return read_into(fd, views) == size or None
        finally:
            os.close(fd)


# -- v1 pages ----------------------------------------------------------------------------------


class SpillsLongerObject(DictBackend):
    """Bug: copies the stored length to the page's address (RDMA style), checking only ``>=``.

    A longer object is a hit and runs over into the next page.
    """

    name = "broken-v1-spill"

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        regions = self.host_pool.page_buffer_meta(host_indices)
        hits = []
        for key, views, region in zip(keys, pages, regions, strict=True):
            value = self._lookup(key)
            if value is None or len(value) < nbytes(views):
                hits.append(False)
                continue
            if len(views) == 1:
                ctypes.memmove(region[0][0], value, len(value))
            else:
                _scatter(value, views)
            hits.append(True)
        return hits


class SizedByPageNbytes(DictBackend):
    """Bug: sizes every v1 object as the pool's ``page_nbytes``, not as its own buffers."""

    name = "broken-page-nbytes"

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        hits = []
        for key, views in zip(keys, pages, strict=True):
            value = self._lookup(key)
            hit = value is not None and len(value) == self.host_pool.page_nbytes
            if hit:
                _scatter(value, views)  # type: ignore[arg-type]
            hits.append(hit)
        return hits


class ReadsFirstIovMax(FilePerKey):
    """Bug: one ``preadv`` per page, given only the first ``IOV_MAX`` buffers (the call's limit)."""

    name = "broken-v1-iov-read"

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        hits = []
        for key, views in zip(keys, pages, strict=True):
            fd = self._open(key)
            if fd is None:
                hits.append(False)
                continue
            try:
                with self.errors.guard(f"read {key!r}"):
                    buffers = [flat(view) for view in views]
                    if os.fstat(fd).st_size != nbytes(buffers):
                        hits.append(False)
                        continue
                    os.preadv(fd, buffers[:IOV_MAX], 0)
                    hits.append(True)
            finally:
                os.close(fd)
        return hits


class OnePwritevPerPage(FilePerKey):
    """Bug: writes each page with one ``pwritev``, which refuses more than ``IOV_MAX`` buffers."""

    name = "broken-v1-iov-write"

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        results = []
        for key, views in zip(keys, pages, strict=True):
            path, temp = self.paths.path(key), self.paths.temp_path(key)
            with self.errors.guard(f"write {key!r}"):
                self.files.ensure_dir(os.path.dirname(path))
                fd = os.open(temp, _WRITE, 0o644)
                try:
                    try:
                        os.pwritev(fd, [flat(view) for view in views], 0)
                    finally:
                        os.close(fd)
                    self.files.publish(temp, path)
                finally:
                    self.files.discard(temp)
            results.append(True)
        return results


class BounceBuffer4MiB(FilePerKey):
    """Bug: reads pages through one 4 MiB staging buffer, filled once: bytes past 4 MiB stay."""

    name = "broken-v1-bounce"
    BOUNCE: ClassVar[bytearray] = bytearray(4 * MiB)
    LOCK: ClassVar[threading.Lock] = threading.Lock()

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        hits = []
        for key, views in zip(keys, pages, strict=True):
            fd = self._open(key)
            if fd is None:
                hits.append(False)
                continue
            try:
                with self.errors.guard(f"read {key!r}"), self.LOCK:
                    size = os.fstat(fd).st_size
                    if size != nbytes(views):
                        hits.append(False)
                        continue
                    staged = memoryview(self.BOUNCE)[: min(size, len(self.BOUNCE))]
                    read_into(fd, [staged])
                    _scatter(staged, views)
                    hits.append(True)
            finally:
                os.close(fd)
        return hits


class StagesThroughBytes(FilePerKey):
    """Bug: claims ``native_zero_copy`` but moves each page through a page-sized ``bytes``."""

    name = "broken-fake-zero-copy"

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        hits = []
        for key, views in zip(keys, pages, strict=True):
            value = self.get(key)
            hit = value is not None and len(as_readable(value)) == nbytes(views)
            if hit:
                _scatter(value, views)  # type: ignore[arg-type]
            hits.append(hit)
        return hits

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        pages = self.page_views(keys, host_indices)
        return [self.set(key, b"".join(views)) for key, views in zip(keys, pages, strict=True)]


def _file_bug(name: str, factory: str, description: str, caught_by: str) -> Bug:
    """Declare a bug of the reference file backend (its options and capabilities)."""
    return bug(
        name,
        factory,
        description,
        caught_by,
        config=REFERENCE.config,
        capabilities=REFERENCE.capabilities,
    )


_M = __name__
_SIZES = "TestValueSizes::test_value_size_roundtrip_every_read_path"
_EMPTY = "TestValueSizes::test_empty_value_is_a_hit"
_DISTINCT = "TestKeyShapes::test_long_keys_differing_at_the_end_stay_distinct"
_MISMATCH = "TestZeroCopy::test_v1_size_mismatch_is_miss_page_untouched"
_IOV = "TestModelPages::test_v1_more_buffers_than_iov_max"
BUGS: list[Bug] = [
    _file_bug(
        "broken-mib-tail",
        f"{_M}:DropsMiBTail",
        "drops the tail after the last whole MiB of a value",
        _SIZES,
    ),
    bug("broken-8mib", f"{_M}:Truncates8MiB", "keeps only 8 MiB of a value", _SIZES),
    _file_bug(
        "broken-empty-file",
        f"{_M}:EmptyFileIsMiss",
        "a 0-byte file (the value b'') reads as a miss",
        _EMPTY,
    ),
    bug("broken-empty-falsy", f"{_M}:EmptyIsFalsy", "batch_get misses b'' (falsy)", _EMPTY),
    bug(
        "broken-keeps-buffer",
        f"{_M}:KeepsCallerBuffer",
        "set keeps the caller's buffer, not a copy",
        "TestRoundTrip::test_set_copies_value_before_returning",
    ),
    bug("broken-key-64", f"{_M}:KeysTruncated64", "keys cut to 64 characters", _DISTINCT),
    _file_bug(
        "broken-name-128",
        f"{_M}:NamesTruncated128",
        "file names cut to 128 characters",
        _DISTINCT,
    ),
    _file_bug(
        "broken-casefold",
        f"{_M}:CaseFoldedNames",
        "file names lower-cased",
        _DISTINCT,
    ),
    _file_bug(
        "broken-temp-name",
        f"{_M}:TempNameOverflows",
        "temporary names over NAME_MAX for keys near 200 characters",
        "TestKeyShapes::test_longest_keys_every_operation",
    ),
    bug(
        "broken-batch-larger-out",
        f"{_M}:BatchAcceptsLargerOut",
        "batch_get fills a larger buffer and reports a hit",
        "TestBatch::test_batch_get_wrong_size_is_miss",
    ),
    _file_bug(
        "broken-larger-out",
        f"{_M}:AcceptsLargerOut",
        "get(key, out) accepts a larger out",
        "TestBufferSize::test_get_wrong_size_out_refused_untouched",
    ),
    bug(
        "broken-v1-spill",
        f"{_M}:SpillsLongerObject",
        "a longer object is a v1 hit that spills into the next page",
        _MISMATCH,
    ),
    bug(
        "broken-page-nbytes",
        f"{_M}:SizedByPageNbytes",
        "v1 objects sized as the pool's page_nbytes",
        "TestUnifiedObjects::test_unified_object_size_mismatch_is_miss",
    ),
    _file_bug(
        "broken-v1-iov-read",
        f"{_M}:ReadsFirstIovMax",
        "v1 reads only the first IOV_MAX buffers of a page",
        _IOV,
    ),
    _file_bug(
        "broken-v1-iov-write",
        f"{_M}:OnePwritevPerPage",
        "v1 writes a page with one pwritev (EINVAL past IOV_MAX)",
        _IOV,
    ),
    _file_bug(
        "broken-v1-bounce",
        f"{_M}:BounceBuffer4MiB",
        "v1 reads bytes past 4 MiB of a page from nowhere",
        "TestModelPages::test_v1_model_page_sizes_every_byte",
    ),
    _file_bug(
        "broken-fake-zero-copy",
        f"{_M}:StagesThroughBytes",
        "claims native_zero_copy, stages pages through bytes",
        "TestNativeZeroCopy::test_native_zero_copy_no_page_sized_staging",
    ),
]
