"""Writes of host pages to storage on a background thread, with a bounded queue.

The scheduler thread owns the radix tree; this thread only moves bytes. A job names the pages
(keys and host slots) of one node; the scheduler keeps the node locked while the job is pending so
that its host slots are neither evicted nor reused, and applies each :class:`Completion` (mark
stored, unlock) when it polls. A full queue refuses a job rather than block the scheduler: the
page stays unstored and is written again when it is next backed up or evicted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import ConfigError

__all__ = ["BackupJob", "BackupWriter", "Completion"]

_STOP = object()
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackupJob:
    """The pages of one node to write: their keys and host slots, and a token for the caller."""

    ticket: object
    keys: Sequence[str]
    host_indices: torch.Tensor


@dataclass(frozen=True)
class Completion:
    """The outcome of a job: whether every page was written."""

    ticket: object
    stored: bool


class BackupWriter:
    """One background thread writing :class:`BackupJob` pages with ``batch_set_v1``.

    Parameters
    ----------
    backend
        The storage backend (with the default layers, so a failure is a ``False``, not a raise).
    capacity
        Most jobs waiting at once.
    """

    def __init__(self, backend: StorageBackend, capacity: int = 64) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity must be a positive int, got {capacity!r}")
        self.backend = backend
        self._jobs: queue.Queue[object] = queue.Queue(capacity)
        self._done: queue.Queue[Completion] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hicache-backup", daemon=True)
        self._closed = False
        self.refused = 0
        self._thread.start()

    def submit(self, job: BackupJob) -> bool:
        """Queue ``job``; return False (and count it) when the queue is full or closed."""
        if self._closed:
            self.refused += 1
            return False
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.refused += 1
            return False
        return True

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Return the completions since the last poll, waiting up to ``timeout_s`` for one."""
        out = []
        if timeout_s > 0:
            try:
                out.append(self._done.get(timeout=timeout_s))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> list[Completion]:
        """Write every queued job, stop the thread and return the completions not yet polled."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_STOP)
            self._thread.join()
        return self.poll()

    @property
    def alive(self) -> bool:
        """Whether the thread is running."""
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            assert isinstance(job, BackupJob)
            try:
                done = self.backend.batch_set_v1(list(job.keys), job.host_indices)
                stored = bool(done) and all(done)
            except Exception:  # logged: one bad job must not stop the writer
                logger.exception("backup of %d pages failed", len(job.keys))
                stored = False
            self._done.put(Completion(job.ticket, stored))
