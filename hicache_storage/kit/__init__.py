"""The backend author's kit: what a correct backend needs besides its client calls.

Everything here is public API, used by the built-in backends and the same for third parties:

* :mod:`~hicache_storage.kit.errors`: :class:`ErrorMap` turns a client's exceptions into the
  contract's typed errors (:func:`is_missing` tells a miss from a failure);
* :mod:`~hicache_storage.kit.pageio`: vectored page I/O over file descriptors and streams,
  handling short transfers and ``IOV_MAX``, reads and writes checksummed as they move
  (:func:`read_checked`, :func:`write_checked`), and whole batches of one-file pages moved
  without holding the GIL (:func:`read_files`, :func:`write_files`, and :func:`read_runs` and
  :func:`write_runs` for values kept in ranges of large files);
* :mod:`~hicache_storage.kit.files`: the fan-out path scheme (:class:`FanoutPaths`) and the
  temp-file-then-link writer (:class:`AtomicFiles`) of one-file-per-key backends;
* :mod:`~hicache_storage.kit.formats`: :class:`FormatManifest`, the per-directory record of
  what objects' bytes mean, for namings whose keys cannot say it;
* :mod:`~hicache_storage.kit.parallel`: :class:`IOWorkers`, many pages in flight on a bounded,
  lazily started thread pool;
* :mod:`~hicache_storage.kit.deadline`: :class:`Deadline`, one call's bound, which the call
  asks before each request and client code finds through the thread (:func:`bounded`);
* :mod:`~hicache_storage.kit.guard`: :func:`closed_guard`, refusing calls after ``close()`` and
  releasing nothing under a call in flight (:class:`CallGate`);
* :mod:`~hicache_storage.kit.faults`: :class:`MediumFaults`, the fault hook that lets the
  conformance suite make a server-less medium fail on demand;
* :mod:`~hicache_storage.kit.baseline`: the :class:`Baseline` interface of ``hicache bench``;
* :mod:`~hicache_storage.kit.integrity`: the record kept beside each value that lets a hit prove
  it holds its key's own, complete bytes;
* :mod:`~hicache_storage.kit.options`: the checks a config struct applies to counts, sizes,
  seconds and ports (:func:`positive_int`, :func:`bytes_of` with its explicit unit rule);
* :mod:`~hicache_storage.kit.lazy`: :func:`lazy_exports`, so a backend package's ``__init__``
  names its classes without importing their client library;
* :mod:`~hicache_storage.kit.services`: local servers started and stopped by PID
  (:class:`~hicache_storage.kit.services.LocalService`) for a backend's ``provision`` module,
  and the :class:`~hicache_storage.kit.services.ServerControl` protocol the suite's fault checks
  drive.

Names load on first use (PEP 562): the core's own modules import the kit's leaf modules
(:mod:`~hicache_storage.kit.options`, :mod:`~hicache_storage.kit.vectored`), which must not pull
in the kit's parts built on the core.

``docs/authors.md`` walks a new backend from nothing to a passing ``hicache check`` with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:
    from .baseline import (
        V1_CALLS,
        Baseline,
        PageBaseline,
    )
    from .deadline import (
        Deadline,
        bounded,
        current_deadline,
    )
    from .errors import (
        Count,
        ErrorMap,
        Rule,
        Verdict,
        is_missing,
    )
    from .faults import (
        FAULT_KINDS,
        OPS,
        POSIX_ERRORS,
        MediumFaults,
    )
    from .files import (
        TEMP_MARK,
        AtomicFiles,
        FanoutPaths,
        clear_entry,
        fsync_dir,
        is_temp,
        temp_name,
    )
    from .formats import (
        MANIFEST_PREFIX,
        FormatManifest,
    )
    from .guard import (
        DRAIN_S,
        GUARDED,
        CallGate,
        closed_guard,
        gate_of,
    )
    from .options import (
        MAX_BYTES,
        MAX_COUNT,
        MAX_TIMEOUT_S,
        bytes_of,
        check_bytes,
        check_count,
        check_port,
        check_seconds,
        positive_int,
    )
    from .pageio import (
        CHECK_CHUNK_BYTES,
        IOV_MAX,
        NATIVE_CHECKED_READS,
        NOT_REGULAR,
        PRESENT,
        PUBLISHED,
        READ_FLAGS,
        UNLINKED,
        FileRead,
        FileWrite,
        RunRead,
        RunWrite,
        flat,
        holds_value,
        nbytes,
        open_regular,
        read_checked,
        read_exact,
        read_files,
        read_into,
        read_runs,
        readinto_views,
        write_checked,
        write_files,
        write_from,
        write_runs,
        write_views,
    )
    from .parallel import (
        IOWorkers,
    )
    from .services import (
        SERVICES_ENV,
        LocalService,
        PausableServerControl,
        ProcessSpec,
        ServerControl,
        ServiceState,
        free_port,
        port_open,
        publish,
        published_services,
        wait_port,
    )

_EXPORTS = {
    "V1_CALLS": ".baseline",
    "Baseline": ".baseline",
    "PageBaseline": ".baseline",
    "Deadline": ".deadline",
    "bounded": ".deadline",
    "current_deadline": ".deadline",
    "Count": ".errors",
    "ErrorMap": ".errors",
    "Rule": ".errors",
    "Verdict": ".errors",
    "is_missing": ".errors",
    "FAULT_KINDS": ".faults",
    "OPS": ".faults",
    "POSIX_ERRORS": ".faults",
    "MediumFaults": ".faults",
    "TEMP_MARK": ".files",
    "AtomicFiles": ".files",
    "FanoutPaths": ".files",
    "clear_entry": ".files",
    "fsync_dir": ".files",
    "is_temp": ".files",
    "temp_name": ".files",
    "MANIFEST_PREFIX": ".formats",
    "FormatManifest": ".formats",
    "DRAIN_S": ".guard",
    "GUARDED": ".guard",
    "CallGate": ".guard",
    "closed_guard": ".guard",
    "gate_of": ".guard",
    "CHECK_CHUNK_BYTES": ".pageio",
    "IOV_MAX": ".pageio",
    "NATIVE_CHECKED_READS": ".pageio",
    "NOT_REGULAR": ".pageio",
    "READ_FLAGS": ".pageio",
    "holds_value": ".pageio",
    "open_regular": ".pageio",
    "flat": ".pageio",
    "nbytes": ".pageio",
    "read_checked": ".pageio",
    "read_files": ".pageio",
    "read_runs": ".pageio",
    "RunRead": ".pageio",
    "RunWrite": ".pageio",
    "write_runs": ".pageio",
    "write_files": ".pageio",
    "FileRead": ".pageio",
    "FileWrite": ".pageio",
    "PRESENT": ".pageio",
    "PUBLISHED": ".pageio",
    "UNLINKED": ".pageio",
    "read_exact": ".pageio",
    "read_into": ".pageio",
    "readinto_views": ".pageio",
    "write_checked": ".pageio",
    "write_from": ".pageio",
    "write_views": ".pageio",
    "IOWorkers": ".parallel",
    "SERVICES_ENV": ".services",
    "LocalService": ".services",
    "PausableServerControl": ".services",
    "ProcessSpec": ".services",
    "ServerControl": ".services",
    "ServiceState": ".services",
    "free_port": ".services",
    "port_open": ".services",
    "publish": ".services",
    "published_services": ".services",
    "wait_port": ".services",
    "MAX_BYTES": ".options",
    "MAX_COUNT": ".options",
    "MAX_TIMEOUT_S": ".options",
    "bytes_of": ".options",
    "check_bytes": ".options",
    "check_count": ".options",
    "check_port": ".options",
    "check_seconds": ".options",
    "positive_int": ".options",
}

__all__ = [
    "AtomicFiles",
    "Baseline",
    "CHECK_CHUNK_BYTES",
    "CallGate",
    "Count",
    "DRAIN_S",
    "Deadline",
    "ErrorMap",
    "FAULT_KINDS",
    "FanoutPaths",
    "FileRead",
    "FileWrite",
    "FormatManifest",
    "GUARDED",
    "IOV_MAX",
    "IOWorkers",
    "LocalService",
    "MANIFEST_PREFIX",
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_TIMEOUT_S",
    "MediumFaults",
    "NATIVE_CHECKED_READS",
    "NOT_REGULAR",
    "OPS",
    "POSIX_ERRORS",
    "PRESENT",
    "PUBLISHED",
    "PageBaseline",
    "READ_FLAGS",
    "PausableServerControl",
    "ProcessSpec",
    "Rule",
    "RunRead",
    "RunWrite",
    "SERVICES_ENV",
    "ServerControl",
    "ServiceState",
    "TEMP_MARK",
    "UNLINKED",
    "V1_CALLS",
    "Verdict",
    "bounded",
    "bytes_of",
    "check_bytes",
    "check_count",
    "check_port",
    "check_seconds",
    "clear_entry",
    "closed_guard",
    "current_deadline",
    "flat",
    "free_port",
    "fsync_dir",
    "gate_of",
    "holds_value",
    "is_missing",
    "is_temp",
    "lazy_exports",
    "nbytes",
    "open_regular",
    "port_open",
    "positive_int",
    "publish",
    "published_services",
    "read_checked",
    "read_exact",
    "read_files",
    "read_into",
    "read_runs",
    "readinto_views",
    "temp_name",
    "wait_port",
    "write_checked",
    "write_files",
    "write_from",
    "write_runs",
    "write_views",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
