"""A correct one-file-per-key backend, written only with the public kit, as a third party would.

It is the starting point of the file-based broken backends: each subclass changes one thing.
The teeth test checks that this one passes the whole suite, so a subclass's failures come from
its bug.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from typing_extensions import Buffer

from hicache_storage import (
    BufferSizeError,
    Capabilities,
    Deployment,
    StorageBackend,
)
from hicache_storage.kit import (
    AtomicFiles,
    ErrorMap,
    FanoutPaths,
    MediumFaults,
    closed_guard,
    flat,
    is_missing,
    is_temp,
    nbytes,
    read_exact,
)

if TYPE_CHECKING:
    import torch

__all__ = ["FilePerKey", "FilePerKeyConfig"]

_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class FilePerKeyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options: the directory holding the objects (the suite gives a fresh one)."""

    root: str


@closed_guard
class FilePerKey(StorageBackend):
    """One file per key under ``root/ab/cd/``, published first-wins with ``link``."""

    name = "reference-file"
    capabilities = Capabilities(
        persistent=True,
        shared=True,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
        atomic_first_wins=True,
    )

    def __init__(self, config: FilePerKeyConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.root = os.path.abspath(config.root)
        self.paths = FanoutPaths(self.root)
        self.files = AtomicFiles()
        self.errors = ErrorMap(f"reference-file at {self.root}")
        self.medium_faults = MediumFaults()
        with self.errors.guard("create its root"):
            os.makedirs(self.root, exist_ok=True)

    # -- reads ----------------------------------------------------------------------------------

    def _open(self, key: str) -> int | None:
        """Open ``key``'s file for reading; None if it is not there."""
        try:
            self.medium_faults.check("read")
            return os.open(self.paths.path(key), _READ)
        except OSError as exc:
            if is_missing(exc):
                return None
            raise self.errors.translate(exc, f"open {key!r}") from exc

    def _read(self, key: str, views: list[memoryview], *, strict: bool) -> bool | None:
        """Read ``key`` into ``views``: None on a miss, False on a size mismatch (or raise)."""
        fd = self._open(key)
        if fd is None:
            return None
        try:
            with self.errors.guard(f"read {key!r}"):
                size = os.fstat(fd).st_size
                if size != nbytes(views):
                    if strict:
                        raise BufferSizeError(
                            f"output buffer has {nbytes(views)} bytes but {key!r} has {size}"
                        )
                    return False
                return read_exact(fd, views) or None
        finally:
            os.close(fd)

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value of ``key`` (or read it into ``out``); None on a miss."""
        if out is not None:
            return out if self._read(key, [flat(memoryview(out))], strict=True) else None
        fd = self._open(key)
        if fd is None:
            return None
        try:
            with self.errors.guard(f"read {key!r}"):
                value = bytearray(os.fstat(fd).st_size)
                return bytes(value) if read_exact(fd, [memoryview(value)]) else None
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        """Return whether ``key``'s file is there."""
        try:
            self.medium_faults.check("stat")
            os.stat(self.paths.path(key))
        except OSError as exc:
            if is_missing(exc):
                return False
            raise self.errors.translate(exc, f"stat {key!r}") from exc
        return True

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its buffer; a size mismatch is a miss."""
        return [
            bool(self._read(key, [flat(memoryview(out))], strict=False))
            for key, out in zip(keys, outs, strict=True)
        ]

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read each key straight into its page's buffers (preadv); a size mismatch is a miss."""
        pages = self.page_views(keys, host_indices)
        return [
            bool(self._read(key, [flat(v) for v in views], strict=False))
            for key, views in zip(keys, pages, strict=True)
        ]

    # -- writes ---------------------------------------------------------------------------------

    def _store(self, key: str, views: list[memoryview]) -> bool:
        try:
            self.medium_faults.check("write")
            self.files.write(self.paths.path(key), views, self.paths.temp_path(key))
        except OSError as exc:
            raise self.errors.translate(exc, f"write {key!r}") from exc
        return True

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds one already (the first value wins)."""
        return self._store(key, [flat(memoryview(value))])

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Write each page's buffers as one object (pwritev)."""
        pages = self.page_views(keys, host_indices)
        return [
            self._store(k, [flat(v) for v in views]) for k, views in zip(keys, pages, strict=True)
        ]

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key``'s file; return whether it was there."""
        try:
            self.medium_faults.check("delete")
            os.unlink(self.paths.path(key))
        except OSError as exc:
            if is_missing(exc):
                return False
            raise self.errors.translate(exc, f"delete {key!r}") from exc
        return True

    def clear(self) -> None:
        """Remove every object (temporary files of writes in flight stay)."""
        with self.errors.guard(f"clear {self.root}"):
            self.medium_faults.check("list")
            for directory, _, names in os.walk(self.root):
                for name in names:
                    if not is_temp(name):
                        self._remove(os.path.join(directory, name))

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def stats(self) -> dict[str, Any]:
        """Return the base stats plus the root."""
        return {**super().stats(), "root": self.root}
