"""The fsspec backend: one object per key under any fsspec URL, written only with the public kit.

Layout
    ``key`` is the object ``<root>/ab/cd/<key>`` (:class:`~hicache_storage.kit.FanoutPaths`,
    ``fanout=False`` drops the two directory levels), where ``root`` is the path of the URL.

Media
    The filesystem behind the URL decides how writes stay atomic and first-wins, and so which
    capabilities an instance claims (:attr:`FsspecBackend.capabilities`):

    * ``file://``: the local path directly, through the kit: a temporary file published with
      ``link()`` (:class:`~hicache_storage.kit.AtomicFiles`), reads with ``preadv`` straight into
      the caller's buffers or the host pool's pages. Persistent, shared between processes, crash
      safe, first-wins, zero-copy. Only a regular file is a value: a FIFO, a directory, a socket
      or a device at a key's path is a miss never waited on, not an existing key, and a write
      of the key replaces it (:func:`~hicache_storage.kit.clear_entry`).
    * ``memory://``: fsspec's in-process store. A value is put whole, under one lock per process
      that makes create-if-absent atomic and serialises reads of the store's shared file
      objects. First-wins; neither persistent nor shared (it dies with the process).
    * ``s3://``: one ``PutObject`` per value with ``If-None-Match: *`` (s3fs's
      ``mode="create"``), so the store keeps the first complete value; a value becomes visible
      only once its upload completed. Persistent, shared, crash safe, first-wins. Reads are one
      ``GetObject`` whose length is checked before any byte reaches the destination.
    * anything else: ``pipe_file(mode="create")`` of whole values, which fsspec implements as
      "write unless it exists" where the filesystem has nothing better; only ``delete`` is
      claimed, since nothing more is known about an arbitrary filesystem.

Errors
    Every medium call sits behind :class:`~hicache_storage.kit.ErrorMap` (client connection
    errors are unavailable, timeouts time out, other ``OSError`` are I/O errors) and a
    :class:`~hicache_storage.kit.MediumFaults` check, so the suite can make any medium fail. A
    missing object is a miss, also when it vanishes between lookup and read. In a batch read a
    key that fails is a miss of its own; the failure is raised only when no key was read. On
    asynchronous filesystems each call runs under one deadline (``deadline_s``): fsspec cancels
    the request when it passes, and bytes reach the caller's buffers only after a request
    returned, so a request abandoned at the deadline never writes into them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from typing_extensions import Buffer

from hicache_storage import (
    BackendTimeoutError,
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
    Deployment,
    HiCacheError,
    MissingDependencyError,
    StorageBackend,
)
from hicache_storage.buffers import scatter
from hicache_storage.kit import (
    READ_FLAGS,
    UNLINKED,
    AtomicFiles,
    Count,
    ErrorMap,
    FanoutPaths,
    IOWorkers,
    MediumFaults,
    Rule,
    closed_guard,
    flat,
    holds_value,
    is_missing,
    is_temp,
    nbytes,
    open_regular,
    read_exact,
    read_files,
    readinto_views,
    write_files,
)
from hicache_storage.redact import redact_text, redact_url, secrets_in

from .config import CAPABILITIES, FsspecConfig, Kind, capabilities

if TYPE_CHECKING:
    import torch

__all__ = ["CAPABILITIES", "FsspecBackend", "Kind", "open_filesystem"]


EXTRAS: dict[str, str] = {"s3": "fsspec-s3", "s3a": "fsspec-s3"}
"""The hicache-storage extra that installs each protocol's fsspec implementation."""

logger = logging.getLogger(__name__)

_MEMORY_LOCK = threading.Lock()
"""``memory://`` is one store per process: its create-if-absent is a check, then a put, and a
read positions the stored file object itself, so every instance in the process shares a lock."""
_CONFLICT_RETRIES = 3
"""Tries of a conditional put that S3 answered ``409`` (another conditional put in flight)."""


def open_filesystem(
    config: FsspecConfig, errors: ErrorMap | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the filesystem of ``config.url`` (uncached, its own instance) and its root path.

    The root comes back normalised: on a local filesystem resolved (``..``, ``.`` and symlinks),
    so ``clear()`` walks only the directory the URL names.

    Raises
    ------
    MissingDependencyError
        If the protocol's implementation (s3fs, gcsfs ...) is not installed.
    ConfigError
        If fsspec does not know the protocol or refuses the storage options, or if the root is
        one the backend would not own alone (see :func:`_owned_root`).
    BackendError
        If opening the filesystem fails otherwise (a refused connection is
        ``BackendUnavailableError``), translated by ``errors``.
    """
    shown = redact_url(config.url)
    protocol = config.url.split("://", 1)[0]
    options = {**config.storage_options, "skip_instance_cache": True, "use_listings_cache": False}
    errors = errors or _errors(config)
    with errors.guard("open the filesystem"):
        try:
            fs, root = fsspec.core.url_to_fs(config.url, **options)
        except ImportError as exc:
            hint = f"pip install 'hicache-storage[{EXTRAS.get(protocol, 'fsspec')}]'"
            if protocol not in EXTRAS:
                hint += f" and the fsspec implementation of {protocol}://"
            raise MissingDependencyError(
                f"backend 'fsspec' needs {exc.name or 'the implementation of ' + protocol + '://'}"
                f" for {shown}, which is not installed; run: {hint}"
            ) from exc
        except (ValueError, TypeError) as exc:
            detail = redact_text(str(exc), secrets_in(config.storage_options))
            raise ConfigError(f"fsspec cannot open {shown}: {detail}") from None
    return fs, _owned_root(fs, root, config.url)


def _owned_root(fs: fsspec.AbstractFileSystem, root: str, url: str) -> str:
    """Return ``root`` normalised, refusing one the backend would not own alone.

    A local root is resolved (``/tmp/..``, ``/./.`` and a symlink to ``/`` all end at ``/``) and
    must be a directory below the filesystem's root; ``file://host/...`` is refused, since fsspec
    reads it as a path relative to the working directory. Elsewhere fsspec passes the path on
    as written, to a store that keeps ``.`` and ``..`` as names or a server that resolves them,
    so no segment may be one; the path (below an ``http://host`` part) must not be empty.

    Raises
    ------
    ConfigError
        Naming the URL (masked) and what to write instead.
    """
    shown = redact_url(url)
    tail = (
        "; name a directory or prefix under it (clear() removes everything of this backend "
        "under the root)"
    )
    if isinstance(fs, LocalFileSystem):
        if not url.split("://", 1)[-1].startswith("/"):
            raise ConfigError(
                f"url {shown} names no absolute path: fsspec reads what follows file:// as a "
                f"path relative to the working directory ({root}), a host included; write the "
                "absolute path as file:///path"
            )
        resolved = os.path.realpath(root)
        if os.path.dirname(resolved) == resolved:
            raise ConfigError(f"url {shown} resolves to the filesystem's root {resolved}{tail}")
        return resolved
    path = urllib.parse.urlsplit(root).path if "://" in root else root
    segments = [urllib.parse.unquote(segment) for segment in path.split("/")]
    if "." in segments or ".." in segments:
        raise ConfigError(
            f"url {shown} has a '.' or '..' segment, which {type(fs).__name__} does not resolve "
            "the way a local path would; name the directory or prefix without them"
        )
    if not path.strip("/"):
        raise ConfigError(f"url {shown} names a filesystem's root{tail}")
    return root


def _kind(fs: fsspec.AbstractFileSystem) -> Kind:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if isinstance(fs, LocalFileSystem):
        return "local"
    if isinstance(fs, MemoryFileSystem):
        return "memory"
    if "s3" in protocols:
        return "s3"
    return "other"


def _client_rules() -> list[Rule]:
    """Return the rules for the client libraries behind fsspec implementations, where installed."""
    rules: list[Rule] = []
    try:
        from botocore import exceptions as boto
    except ImportError:
        pass
    else:
        rules += [
            ((boto.ConnectTimeoutError, boto.ReadTimeoutError), BackendTimeoutError),
            ((boto.ConnectionError, boto.HTTPClientError), BackendUnavailableError),
        ]
    try:
        import aiohttp
    except ImportError:
        pass
    else:
        rules.append((aiohttp.ClientConnectionError, BackendUnavailableError))
    return rules


def _already_stored(exc: BaseException) -> bool:
    """Return whether a failed create-if-absent says the object exists (HTTP 412 included)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileExistsError) or _status(seen) == 412:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _conflict(exc: BaseException) -> bool:
    """Return whether a failed conditional put met another one in flight (HTTP 409)."""
    seen: BaseException | None = exc
    while seen is not None:
        if _status(seen) == 409:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


class _Errors(ErrorMap):
    """The kit's error map, also masking the secrets of the storage options in every message.

    It also tells a miss from an outage that a filesystem reports as one: fsspec's http
    raises ``FileNotFoundError`` from a refused connection, which must not read as a miss.
    """

    def outage(self, exc: BaseException) -> BaseException | None:
        """Return the unavailable or timed-out failure ``exc`` was raised from, if any."""
        seen = exc.__cause__
        while seen is not None:
            if self.kind(seen) in (BackendUnavailableError, BackendTimeoutError):
                return seen
            seen = seen.__cause__
        return None

    def is_miss(self, exc: BaseException) -> bool:
        """Return whether ``exc`` says the object is not there (and not that the medium is down)."""
        return is_missing(exc) and self.outage(exc) is None

    def translate(self, exc: BaseException, what: str, count: Count | None = None) -> HiCacheError:
        """Return the typed error for ``exc``; a miss raised from an outage is the outage."""
        if is_missing(exc):
            exc = self.outage(exc) or exc
        return super().translate(exc, what, count)


def _errors(config: FsspecConfig) -> _Errors:
    """Return the error map of ``config``'s filesystem, masking its URL and option secrets."""
    secrets = secrets_in(config.storage_options) | secrets_in(config.url)
    return _Errors(f"fsspec {redact_url(config.url)}", _client_rules(), secrets=secrets)


@closed_guard
class FsspecBackend(StorageBackend):
    """One object per key under an fsspec URL; see the module docstring for each medium."""

    name = "fsspec"
    capabilities = capabilities()

    def __init__(self, config: FsspecConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.url = redact_url(config.url)
        self.errors = _errors(config)
        self.medium_faults = MediumFaults()
        self.fs, self.root = open_filesystem(config, self.errors)
        self.kind = _kind(self.fs)
        self.capabilities = capabilities(self.kind)
        self.paths = FanoutPaths(self.root, fanout=config.fanout, sep="/")
        self._deadline_s = config.deadline_s
        self._concurrency = config.max_concurrency
        self._timed = bool(getattr(self.fs, "async_impl", False))
        self._files = AtomicFiles()
        self._io = IOWorkers(config.max_concurrency, "hicache-fsspec-io")
        if self.kind == "local":
            with self.errors.guard(f"create {self.root}"):
                os.makedirs(self.root, exist_ok=True)

    def _close(self) -> None:
        self._io.close()

    # -- calls on a remote medium (anything but local and memory) -------------------------------

    @property
    def close_timeout_s(self) -> float:
        """How long ``close()`` waits for calls in flight: ``deadline_s``, which bounds each."""
        return self._deadline_s

    def _deadline(self) -> float:
        return time.monotonic() + self._deadline_s

    def _remote(
        self, op: str, method: str, calls: Sequence[tuple[Any, ...]], deadline: float, **kw: Any
    ) -> list[Any]:
        """Call ``fs.<method>(*args, **kw)`` for each ``args``; return results or exceptions.

        Each call first passes the fault switch for ``op``. On an asynchronous filesystem the
        calls run concurrently (``max_concurrency`` at once) and are cancelled at ``deadline``.
        """
        results: list[Any] = [None] * len(calls)
        pending: list[int] = []
        for i in range(len(calls)):
            try:
                self.medium_faults.check(op)
            except Exception as exc:  # noqa: BLE001 - a result, classified by the caller
                results[i] = exc
            else:
                pending.append(i)
        if pending:
            done = self._run(method, [calls[i] for i in pending], deadline, kw)
            for i, result in zip(pending, done, strict=True):
                results[i] = result
        return results

    def _run(
        self, method: str, calls: list[tuple[Any, ...]], deadline: float, kw: dict[str, Any]
    ) -> list[Any]:
        if not self._timed:
            results: list[Any] = []
            for args in calls:
                try:
                    results.append(getattr(self.fs, method)(*args, **kw))
                except Exception as exc:  # noqa: BLE001 - a result, classified by the caller
                    results.append(exc)
            return results
        left = deadline - time.monotonic()
        late = BackendTimeoutError(
            f"{self.errors.service}: no answer within deadline_s={self._deadline_s:g} s"
        )
        if left <= 0:
            raise late
        call = getattr(self.fs, "_" + method)  # fsspec's async API: the same name with a "_"
        limit = self._concurrency

        async def gather() -> list[Any]:
            gate = asyncio.Semaphore(limit)

            async def one(args: tuple[Any, ...]) -> Any:
                async with gate:
                    return await call(*args, **kw)

            return await asyncio.gather(*(one(args) for args in calls), return_exceptions=True)

        try:
            done: list[Any] = fsspec.asyn.sync(self.fs.loop, gather, timeout=left)
        except TimeoutError as exc:
            raise late from exc
        return done

    def _check(self, results: Sequence[Any], keys: Sequence[str], what: str) -> None:
        """Raise the typed error of the first failure in ``results`` that is not a miss."""
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException) and not self.errors.is_miss(result):
                raise self.errors.translate(result, f"{what} {key!r}") from result

    # -- reads ----------------------------------------------------------------------------------

    def _read_many(
        self, keys: Sequence[str], pages: Sequence[Sequence[memoryview]], *, strict: bool
    ) -> list[bool]:
        """Fill each page's views with its key's object; False for a miss or a size mismatch.

        Raises
        ------
        BufferSizeError
            With ``strict``, if an object's size differs from its views' (nothing written).
        """
        if self.kind == "local" and not strict and len(keys) > 1:
            return self._read_local(keys, pages)
        hits = [False] * len(keys)
        failures: dict[int, HiCacheError] = {}
        if self.kind in ("local", "memory"):
            for i, (key, views) in enumerate(zip(keys, pages, strict=True)):
                try:
                    hits[i] = self._read_one(key, views, strict)
                except BufferSizeError:
                    raise
                except HiCacheError as exc:
                    failures[i] = exc
            return _per_key(hits, failures)
        calls = [(self.paths.path(key),) for key in keys]
        results = self._remote("read", "cat_file", calls, self._deadline())
        for i, (key, data, views) in enumerate(zip(keys, results, pages, strict=True)):
            if not isinstance(data, BaseException):
                hits[i] = _fill(key, data, len(data), views, strict)
            elif not self.errors.is_miss(data):
                failures[i] = self.errors.translate(data, f"read {key!r}")
        return _per_key(hits, failures)

    def _read_local(self, keys: Sequence[str], pages: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Read a batch of local files at once (:func:`~hicache_storage.kit.read_files`).

        A missing file, one of another size, one that comes up short or an entry that is not a
        regular file is a miss; a file that fails is a miss of its own (:func:`_per_key`).
        """
        hits = [False] * len(keys)
        failures: dict[int, HiCacheError] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            try:
                self.medium_faults.check("read")
            except OSError as exc:  # the medium's own errors (the suite's fault hook)
                if not self.errors.is_miss(exc):
                    failures[i] = self.errors.translate(exc, f"read {key!r}")
                continue
            todo.append(i)
        results = read_files(
            [self.paths.path(keys[i]) for i in todo],
            [pages[i] for i in todo],
            [0] * len(todo),
            self._io,
            flags=READ_FLAGS,
        )
        for i, result in zip(todo, results, strict=True):
            if result.error:
                failed = OSError(result.error, os.strerror(result.error))
                if not self.errors.is_miss(failed):
                    failures[i] = self.errors.translate(failed, f"read {keys[i]!r}")
                continue
            hits[i] = result.size == nbytes(pages[i]) == result.read
        return _per_key(hits, failures)

    def _read_one(self, key: str, views: Sequence[memoryview], strict: bool) -> bool:
        """Read ``key`` from a local or memory filesystem straight into ``views``."""
        path = self.paths.path(key)
        try:
            self.medium_faults.check("read")
            if self.kind == "local":
                fd = open_regular(path, READ_FLAGS)
                if fd is None:  # not a file: no value
                    return False
                try:
                    size = os.fstat(fd).st_size
                    return _fill(key, fd, size, views, strict)
                finally:
                    os.close(fd)
            with _MEMORY_LOCK:
                f = self.fs.open(path, "rb")
                return _fill(key, f, f.size, views, strict)
        except HiCacheError:
            raise
        except Exception as exc:
            if self.errors.is_miss(exc):
                return False
            raise self.errors.translate(exc, f"read {key!r}") from exc

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return ``key``'s value, or read it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the object's size (``out`` is left untouched).
        """
        if out is not None:
            return (
                out if self._read_many([key], [[flat(memoryview(out))]], strict=True)[0] else None
            )
        path = self.paths.path(key)
        if self.kind not in ("local", "memory"):
            result = self._remote("read", "cat_file", [(path,)], self._deadline())[0]
            self._check([result], [key], "read")
            return None if isinstance(result, BaseException) else bytes(result)
        try:
            self.medium_faults.check("read")
            if self.kind == "memory":
                return bytes(self.fs.cat_file(path))
            fd = open_regular(path, READ_FLAGS)
            if fd is None:  # not a file: no value
                return None
            try:
                value = bytearray(os.fstat(fd).st_size)
                return value if read_exact(fd, [memoryview(value)]) else None
            finally:
                os.close(fd)
        except Exception as exc:
            if self.errors.is_miss(exc):
                return None
            raise self.errors.translate(exc, f"read {key!r}") from exc

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its buffer; a size mismatch is a miss."""
        return self._read_many(keys, [[flat(memoryview(out))] for out in outs], strict=False)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read each key straight into its page's buffers; a size mismatch is a miss."""
        pages = self.page_views(keys, host_indices)
        return self._read_many(keys, [[flat(v) for v in views] for views in pages], strict=False)

    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds an object."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that hold an object."""
        if self.kind not in ("local", "memory"):
            calls = [(self.paths.path(key),) for key in keys]
            results = self._remote("stat", "info", calls, self._deadline())
            for count, (key, info) in enumerate(zip(keys, results, strict=True)):
                if isinstance(info, BaseException) and self.errors.is_miss(info):
                    return count
                self._check([info], [key], "stat")
                if info.get("type") != "file":
                    return count
            return len(keys)
        for count, key in enumerate(keys):
            try:
                self.medium_faults.check("stat")
                if self.kind == "local":
                    if not holds_value(self.paths.path(key)):
                        return count
                elif not self.fs.isfile(self.paths.path(key)):
                    return count
            except Exception as exc:
                if self.errors.is_miss(exc):
                    return count
                raise self.errors.translate(exc, f"stat {key!r}") from exc
        return len(keys)

    # -- writes ---------------------------------------------------------------------------------

    def _write_many(self, keys: Sequence[str], pages: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Store each page's views back to back as its key's object; the first value wins."""
        if self.kind == "local" and len(keys) > 1:
            self._write_local(keys, pages)
            return [True] * len(keys)
        if self.kind in ("local", "memory"):
            for key, views in zip(keys, pages, strict=True):
                self._write_one(key, views)
            return [True] * len(keys)
        deadline = self._deadline()
        values = [_join(views) for views in pages]
        todo = list(range(len(keys)))
        for attempt in range(_CONFLICT_RETRIES):
            calls = [(self.paths.path(keys[i]), values[i]) for i in todo]
            results = self._remote("write", "pipe_file", calls, deadline, mode="create")
            failed = [
                (i, result)
                for i, result in zip(todo, results, strict=True)
                if isinstance(result, BaseException) and not _already_stored(result)
            ]
            todo = [i for i, result in failed if _conflict(result)]
            for i, result in failed:
                if i not in todo or attempt == _CONFLICT_RETRIES - 1:
                    raise self.errors.translate(result, f"write {keys[i]!r}") from result
            if not todo:
                break
            time.sleep(0.01 * (attempt + 1))
        return [True] * len(keys)

    def _write_local(self, keys: Sequence[str], pages: Sequence[Sequence[memoryview]]) -> None:
        """Publish a batch of local files at once (:func:`~hicache_storage.kit.write_files`).

        Each page goes to a temporary file linked to its key, so the first value wins; if a page
        fails, the others are still written and the first failure is raised.
        """
        failures: dict[int, HiCacheError] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            try:
                self.medium_faults.check("write")
                self._files.ensure_dir(os.path.dirname(self.paths.path(key)))
            except OSError as exc:
                failures[i] = self.errors.translate(exc, f"write {key!r}")
                continue
            todo.append(i)
        temps = [self.paths.temp_path(keys[i]) for i in todo]
        results = write_files(
            [self.paths.path(keys[i]) for i in todo],
            temps,
            [pages[i] for i in todo],
            None,
            self._io,
        )
        for i, temp, result in zip(todo, temps, results, strict=True):
            try:
                if result.error == errno.ENOENT:  # a directory removed behind the cache
                    self._files.forget_dirs()
                    self._write_one(keys[i], pages[i])
                elif result.error:
                    raise OSError(result.error, os.strerror(result.error))
                elif result.outcome == UNLINKED:
                    try:
                        self._files.publish(temp, self.paths.path(keys[i]))
                    finally:
                        self._files.discard(temp)
            except HiCacheError as exc:
                failures[i] = exc
            except OSError as exc:
                failures[i] = self.errors.translate(exc, f"write {keys[i]!r}")
        if failures:
            raise failures[min(failures)]

    def _write_one(self, key: str, views: Sequence[memoryview]) -> None:
        """Publish ``key`` on a local filesystem (temp + link) or in memory (under the lock)."""
        path = self.paths.path(key)
        try:
            self.medium_faults.check("write")
            if self.kind == "local":
                self._files.write(path, views, self.paths.temp_path(key))
                return
            value = _join(views)
            with _MEMORY_LOCK:
                if not self.fs.isfile(path):
                    self.fs.pipe_file(path, value)
        except Exception as exc:
            raise self.errors.translate(exc, f"write {key!r}") from exc

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds one already (the first value wins)."""
        return self._write_many([key], [[flat(memoryview(value))]])[0]

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key, first value wins (concurrently on remote media)."""
        return self._write_many(keys, [[flat(memoryview(value))] for value in values])

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each page's buffers as one object (``pwritev`` on a local filesystem)."""
        pages = self.page_views(keys, host_indices)
        return self._write_many(keys, [[flat(v) for v in views] for views in pages])

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key``'s object; return whether it was there."""
        path = self.paths.path(key)
        if self.kind not in ("local", "memory"):
            # Object stores delete absent objects silently: ask first.
            deadline = self._deadline()
            for method in ("info", "rm_file"):
                result = self._remote("delete", method, [(path,)], deadline)[0]
                if isinstance(result, BaseException) and self.errors.is_miss(result):
                    return False
                self._check([result], [key], "delete")
            return True
        try:
            self.medium_faults.check("delete")
            if self.kind == "local":
                if os.path.isdir(path) and not os.path.islink(path):
                    return False  # a directory is no value: nothing to delete
                os.unlink(path)
            else:
                with _MEMORY_LOCK:
                    self.fs.rm_file(path)
        except Exception as exc:
            if self.errors.is_miss(exc):
                return False
            raise self.errors.translate(exc, f"delete {key!r}") from exc
        return True

    def clear(self) -> None:
        """Remove every object of this backend under its root.

        Only names this backend would store a key at go: temporary files of writes in flight
        and objects of other prefixes under the root stay.
        """
        with self.errors.guard(f"clear {self.root}"):
            mine = [path for path in self._listing() if self._owns(path)]
            self.medium_faults.check("delete")
            if self.kind == "local":
                for path in mine:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                self._files.forget_dirs()
            elif self.kind == "memory":
                with _MEMORY_LOCK:
                    for path in mine:
                        if self.fs.isfile(path):
                            self.fs.rm_file(path)
            elif mine:
                result = self._remote("delete", "rm", [(mine,)], self._deadline())[0]
                if isinstance(result, BaseException) and not self.errors.is_miss(result):
                    raise result

    def _listing(self) -> list[str]:
        """Return every file under the root (none when it does not exist).

        A root that cannot be listed raises rather than reading as empty, which ``os.walk`` and
        fsspec's ``walk`` would make of it: an outage must not pass for an empty store.
        """
        if self.kind == "local":
            self.medium_faults.check("list")
            return [
                os.path.join(directory, name)
                for directory, _, names in os.walk(self.root, onerror=_raise_unless_missing)
                for name in names
            ]
        deadline = self._deadline()
        found = self._remote("list", "find", [(self.root,)], deadline, withdirs=False)[0]
        if isinstance(found, BaseException):
            if self.errors.is_miss(found):
                return []
            raise found
        if not found:
            # fsspec's walk omits what it cannot list (http, an unreachable server): an empty
            # listing is one only if the root is there or plainly absent.
            root = self._remote("list", "info", [(self.root,)], deadline)[0]
            if isinstance(root, BaseException) and not self.errors.is_miss(root):
                raise root
        return list(found)

    def _owns(self, path: str) -> bool:
        """Return whether ``path`` is where this backend stores the key it ends with."""
        name = path.rsplit("/", 1)[-1]
        return not name.startswith(".") and not is_temp(name) and self.paths.path(name) == path

    def stats(self) -> dict[str, Any]:
        """Return the base stats plus the (masked) URL and the medium."""
        return {**super().stats(), "url": self.url, "medium": self.kind}

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<FsspecBackend {self.url!r} ({self.kind}){state}>"


def _per_key(hits: list[bool], failures: Mapping[int, HiCacheError]) -> list[bool]:
    """Return a batch read's hits, its failed keys among the misses; raise if nothing was read.

    One object that cannot be read costs its own key, not the keys read beside it. When no key
    of the batch was read, the first failure is raised, so the layers count a failing medium as
    an outage.

    Raises
    ------
    HiCacheError
        The first failure, if the batch has failures and no hit.
    """
    if failures and not any(hits):
        raise failures[min(failures)]
    if failures:
        logger.warning(
            "fsspec backend: %d of %d keys of a batch could not be read and are misses: %s",
            len(failures),
            len(hits),
            failures[min(failures)],
        )
    return hits


def _raise_unless_missing(exc: OSError) -> None:
    """``os.walk``'s error handler: a directory removed meanwhile is empty, anything else fails."""
    if not is_missing(exc):
        raise exc


def _fill(key: str, source: Any, size: int, views: Sequence[memoryview], strict: bool) -> bool:
    """Move an object of ``size`` bytes from ``source`` into ``views`` if the sizes agree.

    ``source`` is the object's bytes, a file descriptor (``preadv``) or a binary stream.
    Returns False on a size mismatch (nothing written) or a short read (a vanishing object).

    Raises
    ------
    BufferSizeError
        With ``strict``, on a size mismatch.
    """
    want = nbytes(views)
    if size != want:
        if strict:
            raise BufferSizeError(f"output buffer has {want} bytes but {key!r} has {size}")
        return False
    if isinstance(source, int):
        return read_exact(source, views)
    if isinstance(source, (bytes, bytearray)):
        scatter(source, views)
        return True
    return readinto_views(source, views) == want


def _join(views: Sequence[memoryview]) -> bytes:
    """Return the views back to back as one immutable value (the caller may reuse its buffers)."""
    return bytes(views[0]) if len(views) == 1 else b"".join(views)
