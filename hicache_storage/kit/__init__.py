"""The backend author's kit: what a correct backend needs besides its client calls.

Everything here is public API, used by the built-in backends and the same for third parties:

* :mod:`~hicache_storage.kit.errors`: :class:`ErrorMap` turns a client's exceptions into the
  contract's typed errors (:func:`is_missing` tells a miss from a failure);
* :mod:`~hicache_storage.kit.pageio`: vectored page I/O over file descriptors and streams,
  handling short transfers and ``IOV_MAX``, and reads and writes checksummed as they move
  (:func:`read_checked`, :func:`write_checked`);
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
* :mod:`~hicache_storage.kit.services`: local servers started and stopped by PID
  (:class:`~hicache_storage.kit.services.LocalService`) for a backend's ``provision`` module,
  and the :class:`~hicache_storage.kit.services.ServerControl` protocol the suite's fault checks
  drive.

``docs/authors.md`` walks a new backend from nothing to a passing ``hicache check`` with it.
"""

from __future__ import annotations

from .baseline import V1_CALLS, Baseline, PageBaseline
from .deadline import Deadline, bounded, current_deadline
from .errors import Count, ErrorMap, Rule, Verdict, is_missing
from .faults import FAULT_KINDS, OPS, POSIX_ERRORS, MediumFaults
from .files import TEMP_MARK, AtomicFiles, FanoutPaths, fsync_dir, is_temp, temp_name
from .formats import MANIFEST_PREFIX, FormatManifest
from .guard import DRAIN_S, GUARDED, CallGate, closed_guard, gate_of
from .pageio import (
    CHECK_CHUNK_BYTES,
    IOV_MAX,
    NATIVE_CHECKED_READS,
    flat,
    nbytes,
    read_checked,
    read_exact,
    read_into,
    readinto_views,
    write_checked,
    write_from,
    write_views,
)
from .parallel import IOWorkers
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

__all__ = [
    "DRAIN_S",
    "FAULT_KINDS",
    "GUARDED",
    "CHECK_CHUNK_BYTES",
    "IOV_MAX",
    "NATIVE_CHECKED_READS",
    "MANIFEST_PREFIX",
    "OPS",
    "POSIX_ERRORS",
    "SERVICES_ENV",
    "TEMP_MARK",
    "V1_CALLS",
    "AtomicFiles",
    "Baseline",
    "CallGate",
    "Count",
    "Deadline",
    "ErrorMap",
    "FanoutPaths",
    "FormatManifest",
    "IOWorkers",
    "LocalService",
    "MediumFaults",
    "PageBaseline",
    "PausableServerControl",
    "ProcessSpec",
    "Rule",
    "ServerControl",
    "ServiceState",
    "Verdict",
    "bounded",
    "closed_guard",
    "current_deadline",
    "flat",
    "free_port",
    "fsync_dir",
    "gate_of",
    "is_missing",
    "is_temp",
    "nbytes",
    "port_open",
    "publish",
    "published_services",
    "read_checked",
    "read_exact",
    "read_into",
    "readinto_views",
    "write_checked",
    "temp_name",
    "wait_port",
    "write_from",
    "write_views",
]
