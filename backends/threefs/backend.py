"""The 3FS backend: KV pages in slots of large preallocated files, a metadata map of key → slots.

Layout
    ``<path>/<namespace>.<i>.bin`` for ``i < file_count``, each ``file_size`` bytes cut into
    ``slot_bytes`` slots. A value takes ``ceil(len / slot_bytes)`` slots (one per KV page when
    ``slot_bytes`` is the page size), usually consecutive.

Writes (see :mod:`.metadata` for the protocol)
    One ``reserve`` for the whole batch, the bytes written straight from the caller's buffers
    into the granted slots (``pwritev``, or usrbio), optionally ``fsync``-ed, then one ``commit``:
    a key is visible only once its bytes are in place. The first writer of a key wins; a set that
    finds another writer at work waits for it (up to ``timeout_s``). A write that outlives its
    lease is not committed. A writer killed mid-write leaves only a reservation, invisible to
    readers, whose slots come back when the lease runs out.

Reads
    One ``lookup``, the bytes read straight into the caller's buffers (``preadv``, or usrbio),
    then one ``confirm``: a read that raced an eviction of its key is a miss (its output buffer
    may then hold other bytes, as after any miss it must not be used).

Integrity (``integrity=True``, the default)
    Each file ends with one 32-byte :mod:`~hicache_storage.kit.integrity` record per slot. A write
    puts the value's record (key digest, length, CRC32C, and the generation: the reservation's
    epoch and id) at its first slot, in the same batch of I/O as the bytes; a read fetches it in
    the same batch and verifies it after ``confirm``. The metadata may hand a slot to another key
    once a writer's lease ran out, and nothing can stop that writer's late bytes from landing:
    the record makes them a miss instead of a hit (see docs/backends/3fs.md). A failed check is
    counted in ``stats()["integrity_failures"]`` and the key is deleted from the map.

Metadata
    In process (``metadata_url`` unset): this instance is the only user of its files, which it
    locks. Through a ``hicache metadata-server``: every process and instance shares the map.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendClosedError,
    BackendError,
    BackendIOError,
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
)
from hicache_storage.kit import POSIX_ERRORS, ErrorMap, IOWorkers, MediumFaults, closed_guard, flat
from hicache_storage.kit.integrity import RECORD_BYTES, check, seal, verify
from hicache_storage.kit.integrity import record as make_record

from .config import ThreeFSConfig, capabilities
from .io import IORequest, SlotIO, open_file, open_io
from .metadata import GeometryError, Location, Metadata, Reservation
from .metadata_http import HttpMetadata, Unauthorized
from .metadata_local import LocalMetadata

if TYPE_CHECKING:
    import torch

__all__ = ["ThreeFSBackend", "generation_of", "namespace_of"]

logger = logging.getLogger(__name__)

_ERRORS = ErrorMap("3fs backend", [(GeometryError, BackendUnavailableError)])
"""A changed metadata geometry means the service was replaced under us: unavailable."""

_MAX_BACKOFF_S = 0.05
_ID_BITS = 40


def generation_of(epoch: str, id: int) -> int:
    """Return the generation a record carries: 24 bits of the epoch's digest, 40 of the id.

    Ids restart in a new epoch (a metadata service restarted without its snapshot), so the
    epoch keeps an old record from matching a new entry with the same id.
    """
    tag = int.from_bytes(hashlib.blake2b(epoch.encode(), digest_size=3).digest(), "little")
    return (tag << _ID_BITS) | (id & ((1 << _ID_BITS) - 1))


def namespace_of(config: ThreeFSConfig, deployment: Deployment) -> str:
    """Return the metadata namespace (and data-file stem) of this rank.

    ``ownership="all"``: ``file_prefix``. ``"rank"``: ``file_prefix`` plus the rank's TP (left
    out for MLA, whose TP ranks share one copy), PP and CP positions, e.g. ``hicache.tp1of4``.
    """
    if config.ownership == "all":
        return config.file_prefix
    parts = [config.file_prefix]
    if not deployment.is_mla:
        parts.append(f"tp{deployment.tp_rank}of{deployment.tp_size}")
    if deployment.pp_size > 1:
        parts.append(f"pp{deployment.pp_rank}of{deployment.pp_size}")
    if deployment.cp_size > 1:
        parts.append(f"cp{deployment.cp_rank}of{deployment.cp_size}")
    return ".".join(parts)


class _Cursor:
    """Hands out consecutive byte ranges of a list of buffers."""

    __slots__ = ("index", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = [view for view in views if view.nbytes]
        self.index = 0

    def take(self, nbytes: int) -> list[memoryview]:
        taken: list[memoryview] = []
        while nbytes:
            view = self.views[self.index]
            if view.nbytes <= nbytes:
                taken.append(view)
                nbytes -= view.nbytes
                self.index += 1
            else:
                taken.append(view[:nbytes])
                self.views[self.index] = view[nbytes:]
                nbytes = 0
        return taken


@closed_guard(also=("locate",))
class ThreeFSBackend(StorageBackend):
    """Stores values in slots of large files on a 3FS mount; see the module docstring.

    Parameters
    ----------
    config
        The backend's settings.
    deployment
        The rank this instance serves: with ``ownership="rank"`` it picks the namespace, and
        for MLA only TP rank 0 writes.

    Raises
    ------
    ConfigError
        If the metadata service refuses the token or knows the namespace with another geometry,
        if another instance holds the files with in-process metadata, or if an MLA deployment
        with several TP ranks has no shared metadata service.
    BackendUnavailableError, BackendTimeoutError
        If the metadata service cannot be reached.
    BackendIOError
        If the data files cannot be created.
    """

    name = "3fs"

    def __init__(self, config: ThreeFSConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.config = config
        self.deployment = deployment if deployment is not None else Deployment()
        self.namespace = namespace_of(config, self.deployment)
        self.root = os.path.abspath(os.path.expanduser(config.path))
        self.geometry = config.geometry()
        self.paths = [
            os.path.join(self.root, f"{self.namespace}.{i}.bin") for i in range(config.file_count)
        ]
        shared = config.metadata_url is not None
        if not shared and self.deployment.is_mla and self.deployment.tp_size > 1:
            raise ConfigError(
                "an MLA deployment with tp_size > 1 shares one copy of each page between its TP "
                "ranks (rank 0 writes, the others read): set metadata_url to a shared "
                "hicache metadata-server"
            )
        if config.ownership == "rank" and self.deployment.key_scheme == "unified":
            raise ConfigError(
                "ownership='rank' gives every rank a namespace of its own, so deployments of "
                "other topologies could not find each other's unified objects: use "
                "ownership='all' with key_scheme 'unified'"
            )
        self._writer = self.deployment.scheme().is_writer
        self._records = config.integrity
        self.capabilities = capabilities(config)
        self._counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._meta: Metadata | None = None
        self._io: SlotIO | None = None
        self._sealers = IOWorkers(config.io_threads, "hicache-3fs-seal")
        """Threads that checksum a batch's pages at once (CRC32C gives up the GIL)."""
        self.medium_faults = MediumFaults(
            {kind: POSIX_ERRORS[kind] for kind in ("io", "unavailable", "timeout")}
        )
        """The suite's fault hook, checked before each data I/O (slots never vanish)."""
        try:
            self._setup(shared)
        except BaseException:
            self._release()
            raise

    def _setup(self, shared: bool) -> None:
        config = self.config
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise BackendIOError(f"3fs backend could not create {self.root!r}: {exc}") from exc
        if shared:
            assert config.metadata_url is not None
            self._meta = HttpMetadata(
                config.metadata_url, token=config.metadata_token, timeout_s=config.timeout_s
            )
        else:
            self._lock_files()
            self._meta = LocalMetadata()
        try:
            self._meta.open(self.namespace, self.geometry)
        except (GeometryError, Unauthorized) as exc:
            message = f"3fs backend cannot use namespace {self.namespace!r}: {exc}"
            raise ConfigError(message) from exc
        with self._translate("create its data files"):
            self._io = open_io(
                self.paths,
                config.stored_file_size,
                engine=config.io_engine,
                io_threads=config.io_threads,
                usrbio_entries=config.usrbio_entries,
                usrbio_buffer_bytes=config.usrbio_buffer_bytes,
            )

    @property
    def close_timeout_s(self) -> float:
        """How long ``close()`` waits for calls in flight: the longest a call takes.

        At most two metadata requests of ``timeout_s`` each, plus up to ``timeout_s`` a set
        waits for another writer of its key.
        """
        return 3 * self.config.timeout_s

    # -- the contract ---------------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value of ``key`` (a ``bytearray``), or read it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the value's size (``out`` is left untouched).
        """
        meta, io = self._parts()
        dst = None if out is None else as_writable(out)
        with self._translate(f"read {key!r}"):
            found = meta.lookup(self.namespace, [key])
            location = found.locations[0]
            if location is None:
                return None
            if dst is not None and dst.nbytes != location.length:
                raise BufferSizeError(
                    f"output buffer has {dst.nbytes} bytes but the object stored under "
                    f"{key!r} has {location.length}"
                )
            target = memoryview(bytearray(location.length)) if dst is None else dst
            record = bytearray(RECORD_BYTES)
            self.medium_faults.check("read")
            io.read(self._plan(location, [target]) + self._record_at(location, record))
            confirmed = meta.confirm(self.namespace, found.epoch, [(key, location.id)])[0]
        if not confirmed:
            self._count("raced_reads")
            return None
        if self._records and not self._verified(key, location, found.epoch, [target], record):
            return None
        return out if out is not None else target.obj

    def exists(self, key: str) -> bool:
        """Return whether ``key`` is committed."""
        return self.batch_exists([key]) == 1

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless a complete value is there (the first one wins).

        Returns False when it does not fit, another writer held the key past ``timeout_s``, or
        this rank is an MLA reader and the key is absent.
        """
        return self._store([key], [[as_readable(value)]])[0]

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its output buffer (a size mismatch is a miss)."""
        if len(keys) != len(outs):
            return super().batch_get(keys, outs)  # raises the mismatch error
        return self._load(keys, [[as_writable(out)] for out in outs])

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key with one reserve and one commit for the batch."""
        if len(keys) != len(values):
            return super().batch_set(keys, values)  # raises the mismatch error
        return self._store(keys, [[as_readable(value)] for value in values])

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of committed keys (one metadata call)."""
        meta, _ = self._parts()
        if not keys:
            return 0
        with self._translate("look up keys"):
            return meta.exists(self.namespace, keys)

    # -- zero-copy page I/O ---------------------------------------------------------------------

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read each key straight into its page's buffers in the host pool."""
        self._parts()
        pages = self.page_views(keys, host_indices)
        return self._load(keys, [[flat(view) for view in views] for views in pages])

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Write each key straight from its page's buffers in the host pool."""
        self._parts()
        pages = self.page_views(keys, host_indices)
        return self._store(keys, [[flat(view) for view in views] for views in pages])

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it was committed."""
        meta, _ = self._parts()
        with self._translate(f"delete {key!r}"):
            return meta.delete(self.namespace, [key])[0]

    def clear(self) -> None:
        """Remove every committed key of this namespace (other namespaces are untouched)."""
        meta, _ = self._parts()
        with self._translate("clear"):
            meta.clear(self.namespace)

    def stats(self) -> dict[str, Any]:
        """Return this instance's counters and, while open, the namespace's from the metadata."""
        with self._counter_lock:
            counters = dict(self._counters)
        result: dict[str, Any] = {
            "backend": self.name,
            "namespace": self.namespace,
            "path": self.root,
            "io_engine": self._io.kind if self._io is not None else None,
            "metadata": self.config.metadata_url or "in-process",
            "slot_bytes": self.geometry.slot_bytes,
            "max_bytes": self.geometry.capacity,
            "max_objects": self.geometry.total_slots,
            "integrity": self._records,
            "writer": self._writer,
            **counters,
        }
        if not self._closed and self._meta is not None:
            try:
                result.update(self._meta.stats(self.namespace))
            except BackendError as exc:
                result["metadata_error"] = str(exc)
        return result

    def _close(self) -> None:
        self._release()

    def _release(self) -> None:
        self._sealers.close()
        io, self._io = self._io, None
        meta, self._meta = self._meta, None
        try:
            if io is not None:
                io.close()
        finally:
            if meta is not None:
                meta.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def locate(self, key: str, offset: int) -> tuple[str, int] | None:
        """Return the data file and position of byte ``offset`` of ``key``'s committed value.

        ``None`` when the key is not committed or the value is shorter. For tools and the
        conformance suite's corruption hook.
        """
        meta, _ = self._parts()
        with self._translate(f"look up {key!r}"):
            location = meta.lookup(self.namespace, [key]).locations[0]
        if location is None or not 0 <= offset < location.length:
            return None
        slot_bytes, per_file = self.geometry.slot_bytes, self.geometry.slots_per_file
        skip, within = divmod(offset, slot_bytes)
        for first, count in location.extents:
            if skip < count:
                file, index = divmod(first + skip, per_file)
                return self.paths[file], index * slot_bytes + within
            skip -= count
        return None

    # -- internals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """Turn file and metadata failures into the typed backend errors (the one place)."""
        try:
            yield
        except (OSError, GeometryError) as exc:
            raise _ERRORS.translate(exc, what) from exc

    def _parts(self) -> tuple[Metadata, SlotIO]:
        if self._closed or self._meta is None or self._io is None:
            raise BackendClosedError(f"3fs backend at {self.root!r} is closed; create a new one")
        return self._meta, self._io

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[name] += n

    def _lock_files(self) -> None:
        """Take the lock that makes this instance the only user of its files."""
        path = os.path.join(self.root, f"{self.namespace}.lock")
        try:
            fd = open_file(path)
        except OSError as exc:
            raise BackendIOError(f"3fs backend could not open {path!r}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"another 3fs backend instance uses the files of namespace {self.namespace!r} "
                f"in {self.root!r} with in-process metadata; close it, or share one "
                f"hicache metadata-server between them (metadata_url)"
            ) from None
        self._lock_fd = fd

    def _plan(self, location: Location, views: list[memoryview]) -> list[IORequest]:
        """Map a value's slot runs onto its buffers."""
        geometry = self.geometry
        per_file, slot = geometry.slots_per_file, geometry.slot_bytes
        cursor = _Cursor(views)
        remaining = location.length
        requests = []
        for first, count in location.extents:
            while count and remaining:
                file, index = divmod(first, per_file)
                run = min(count, per_file - index)
                nbytes = min(run * slot, remaining)
                requests.append(IORequest(file, index * slot, cursor.take(nbytes)))
                remaining -= nbytes
                first += run
                count -= run
        if remaining:
            raise BackendUnavailableError(
                f"the metadata gave {location.extents} for {location.length} bytes: too few slots"
            )
        return requests

    def _record_at(self, location: Location, record: Buffer) -> list[IORequest]:
        """Map a value's integrity record (at its first slot's) onto ``record``.

        Nothing when integrity records are off or the value has no slot.
        """
        if not (self._records and location.extents):
            return []
        file, index = divmod(location.extents[0][0], self.geometry.slots_per_file)
        offset = self.config.file_size + index * RECORD_BYTES
        return [IORequest(file, offset, [memoryview(record).cast("B")])]

    def _verified(
        self,
        key: str,
        location: Location,
        epoch: str,
        views: list[memoryview],
        record: Buffer,
        crc: int | None = None,
    ) -> bool:
        """Check a confirmed read against its record; on failure count it and drop the key.

        ``crc`` is the value's CRC32C when it was computed during the read (else it is
        computed here).
        """
        if not location.extents:  # b"": no slot, so no record and no bytes to vouch for
            return True
        generation = generation_of(epoch, location.id)
        if crc is None:
            reason = verify(record, key, views, generation=generation)
        else:
            reason = check(record, key, location.length, crc, generation)
        if reason is None:
            return True
        self._count(f"integrity_{reason.replace(' ', '_')}")
        logger.warning(
            "3fs backend: %r in namespace %r failed its integrity check (%s); deleted",
            key,
            self.namespace,
            reason,
        )
        meta, _ = self._parts()
        with contextlib.suppress(BackendError):
            meta.delete(self.namespace, [key])
        return False

    def _load(self, keys: Sequence[str], dests: list[list[memoryview]]) -> list[bool]:
        """Read each key into its buffers (a size mismatch is a miss); return per-key hits."""
        meta, io = self._parts()
        hits = [False] * len(keys)
        if not keys:
            return hits
        with self._translate("read"):
            found = meta.lookup(self.namespace, keys)
            runs: list[list[IORequest]] = []
            candidates: list[tuple[int, Location, bytearray]] = []
            for i, (location, views) in enumerate(zip(found.locations, dests, strict=True)):
                if location is None or location.length != sum(v.nbytes for v in views):
                    continue
                record = bytearray(RECORD_BYTES)
                runs.append(self._plan(location, views) + self._record_at(location, record))
                candidates.append((i, location, record))
            if not candidates:
                return hits
            self.medium_faults.check("read")
            crcs = None
            if self._records:  # checksummed while read, where the I/O can
                crcs = io.read_checked(runs, [location.length for _, location, _ in candidates])
            if crcs is None:
                io.read([request for run in runs for request in run])
            pairs = [(keys[i], location.id) for i, location, _ in candidates]
            confirmed = meta.confirm(self.namespace, found.epoch, pairs)
        raced = len(candidates) - sum(confirmed)
        if raced:
            self._count("raced_reads", raced)
        for j, ((i, location, record), ok) in enumerate(zip(candidates, confirmed, strict=True)):
            hits[i] = ok and (
                not self._records
                or self._verified(
                    keys[i],
                    location,
                    found.epoch,
                    dests[i],
                    record,
                    None if crcs is None else crcs[j],
                )
            )
        return hits

    def _store(self, keys: Sequence[str], sources: list[list[memoryview]]) -> list[bool]:
        """Write each key's buffers under the slot protocol; return per key whether it is stored."""
        meta, _ = self._parts()
        if not keys:
            return []
        if not self._writer:
            self._count("skipped_writes", len(keys))
            with self._translate("look up keys"):
                found = meta.lookup(self.namespace, keys)
            return [location is not None for location in found.locations]
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        sizes = {i: sum(view.nbytes for view in sources[i]) for i in first.values()}
        results: dict[int, bool] = {}
        todo = list(first.values())
        deadline = time.monotonic() + self.config.timeout_s
        delay = 0.001
        with self._translate("write"):
            while True:
                started = time.monotonic()
                granted = meta.reserve(
                    self.namespace, self.geometry, [(keys[i], sizes[i]) for i in todo]
                )
                writes = []
                waiting = []
                for i, grant in zip(todo, granted.grants, strict=True):
                    if grant.status == "exists":
                        results[i] = True
                    elif grant.status == "reserved":
                        writes.append((i, Location(grant.id, sizes[i], grant.extents)))
                    elif grant.status in ("busy", "starting"):
                        waiting.append(i)
                    else:
                        results[i] = False
                        self._count(f"refused_{grant.status}")
                if writes:
                    results.update(self._fill(granted, keys, writes, sources, started))
                if not waiting:
                    break
                if time.monotonic() + delay > deadline:
                    for i in waiting:
                        results[i] = False
                    self._count("busy_timeouts", len(waiting))
                    break
                time.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                todo = waiting
        return [results[first[key]] for key in keys]

    def _fill(
        self,
        granted: Reservation,
        keys: Sequence[str],
        writes: list[tuple[int, Location]],
        sources: list[list[memoryview]],
        started: float,
    ) -> dict[int, bool]:
        """Write reserved slots, then commit them (or abort when anything went wrong)."""
        meta, io = self._parts()
        ids = [location.id for _, location in writes]
        records = [bytearray(RECORD_BYTES) for _ in writes]
        values = [self._plan(location, list(sources[i])) for i, location in writes]
        flat_values = [request for run in values for request in run]
        sealing = [
            request
            for (_, location), record in zip(writes, records, strict=True)
            for request in self._record_at(location, record)
        ]

        def seal_one(j: int) -> None:
            i, location = writes[j]
            generation = generation_of(granted.epoch, location.id)
            records[j][:] = seal(keys[i], sources[i], generation=generation)

        try:
            self.medium_faults.check("write")
            crcs = None
            if self._records:  # each value checksummed while it is written, where the I/O can
                crcs = io.write_checked(values)
            if crcs is None:
                # The records first, every page's CRC32C at once: one after another they would
                # serialise the batch on the calling thread before a byte is written.
                if self._records:
                    self._sealers.map(seal_one, range(len(writes)))
                io.write(flat_values + sealing)
            else:
                for j, ((i, location), crc) in enumerate(zip(writes, crcs, strict=True)):
                    generation = generation_of(granted.epoch, location.id)
                    records[j][:] = make_record(
                        keys[i], location.length, crc, generation=generation
                    )
                # The records, 32 bytes each, as one run: one call, no thread of their own.
                io.write_checked([sealing])
            if self.config.fsync == "before_commit":
                io.sync([request.file for request in flat_values + sealing])
        except BaseException:
            with contextlib.suppress(BackendError):
                meta.abort(self.namespace, granted.epoch, ids)
            raise
        if time.monotonic() - started >= granted.lease_s:
            # The lease ran out while writing: the slots may already belong to someone else.
            with contextlib.suppress(BackendError):
                meta.abort(self.namespace, granted.epoch, ids)
            self._count("lease_overruns", len(ids))
            return {i: False for i, _ in writes}
        committed = meta.commit(self.namespace, granted.epoch, ids)
        lost = len(ids) - sum(committed)
        if lost:
            self._count("commits_refused", lost)
        return {i: ok for (i, _), ok in zip(writes, committed, strict=True)}

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<ThreeFSBackend {self.root!r} namespace={self.namespace!r}{state}>"
