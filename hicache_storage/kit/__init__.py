"""The backend author's kit: what a correct backend needs besides its client calls.

Everything here is public API, used by the built-in backends and the same for third parties:

* :mod:`~hicache_storage.kit.errors`: :class:`ErrorMap` turns a client's exceptions into the
  contract's typed errors (:func:`is_missing` tells a miss from a failure);
* :mod:`~hicache_storage.kit.pageio`: vectored page I/O over file descriptors and streams,
  handling short transfers and ``IOV_MAX``;
* :mod:`~hicache_storage.kit.files`: the fan-out path scheme (:class:`FanoutPaths`) and the
  temp-file-then-link writer (:class:`AtomicFiles`) of one-file-per-key backends;
* :mod:`~hicache_storage.kit.guard`: :func:`closed_guard`, refusing calls after ``close()``;
* :mod:`~hicache_storage.kit.faults`: :class:`MediumFaults`, the fault hook that lets the
  conformance suite make a server-less medium fail on demand;
* :mod:`~hicache_storage.kit.baseline`: the :class:`Baseline` interface of ``hicache bench``.

``docs/authors.md`` walks a new backend from nothing to a passing ``hicache check`` with it.
"""

from __future__ import annotations

from .baseline import V1_CALLS, Baseline, PageBaseline
from .errors import ErrorMap, Rule, is_missing
from .faults import FAULT_KINDS, OPS, POSIX_ERRORS, MediumFaults
from .files import TEMP_MARK, AtomicFiles, FanoutPaths, fsync_dir, is_temp, temp_name
from .guard import GUARDED, closed_guard
from .pageio import (
    IOV_MAX,
    flat,
    nbytes,
    read_exact,
    read_into,
    readinto_views,
    write_from,
    write_views,
)

__all__ = [
    "FAULT_KINDS",
    "GUARDED",
    "IOV_MAX",
    "OPS",
    "POSIX_ERRORS",
    "TEMP_MARK",
    "V1_CALLS",
    "AtomicFiles",
    "Baseline",
    "ErrorMap",
    "FanoutPaths",
    "MediumFaults",
    "PageBaseline",
    "Rule",
    "closed_guard",
    "flat",
    "fsync_dir",
    "is_missing",
    "is_temp",
    "nbytes",
    "read_exact",
    "read_into",
    "readinto_views",
    "temp_name",
    "write_from",
    "write_views",
]
