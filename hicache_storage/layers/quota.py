"""A byte quota on a namespace, shared by every process and machine that writes into it.

Tenants sharing one store each write under a namespace of their own (the file backend's root,
Redis's prefix, S3's prefix): each namespace's pages are the only ones its backend reads, evicts
or clears. This layer bounds a namespace's bytes by :attr:`QuotaConfig.bytes
<hicache_storage.config.QuotaConfig.bytes>` against a ledger all its writers share
(:mod:`hicache_storage.quota`):

* Each write (``set``, ``batch_set``, ``batch_set_v1``) first reserves its bytes in the ledger.
  When the namespace is full, the reservation names the namespace's least recently used pages,
  which the layer deletes before writing. Room other writers hold (their writes, their
  evictions) is waited for, up to a second; the pages of a batch past the quota itself, or that
  found no room in that time, are not stored (``False``, counted as shed). The write's bytes are
  settled as pages once the backend answered, so writers on different machines never overshoot
  the quota together.
* Reads mark their hits as used: the times are kept here and reach the ledger with this
  process's next reservation (or once a few thousand gathered, or every few seconds), so a read
  costs the ledger nothing on its own.
* A key repeated in one batch is written and counted once, with its last value (the last write
  wins); each of its positions reports that write.
* ``delete`` and ``clear`` take the pages out of the ledger, then out of the store: a write racing
  them settles after they left the ledger, so the ledger may count a page they then removed
  (until it is evicted), never miss one that stays stored.

A ledger that does not answer is an infrastructure error (a counted miss under degrade); a write
is then not stored, never stored past the quota.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from ..buffers import as_readable
from ..capacity import Capacity
from ..errors import BackendError, BackendIOError, ConfigError
from .base import ForwardingBackend

if TYPE_CHECKING:
    import torch

    from ..backend import StorageBackend
    from ..config import QuotaConfig
    from ..quota import Grant, QuotaLedger

__all__ = ["QuotaLayer"]

_TOUCHES_PER_FLUSH = 4096
"""Reads gathered before they are written to the ledger without waiting for a write: a bound on
the memory they take, and one ledger step per thousands of page reads."""

_TOUCH_FLUSH_S = 5.0
"""Longest a read waits to reach the ledger when this process writes nothing meanwhile; other
writers' evictions see the read after at most this long."""


_NO_HOLD = ""
"""A hold id no ledger gives out: settling it only records pages (a delete's, put back)."""

_ROOM_WAIT_S = 1.0
"""Longest a write waits for room that other writers hold (their writes, their evictions) before
it is shed: with a store that answers they take milliseconds; a store that does not is the
degrade layer's, and a write is better shed than queued for longer."""


class QuotaLayer(ForwardingBackend):
    """Hold ``inner``'s namespace within ``config.bytes`` (see the module docstring).

    ``ledger`` overrides the one ``config`` names (tests pass their own); ``clock`` gives the
    wall-clock time the ledger's holds and use times are kept in (shared by machines).
    """

    def __init__(
        self,
        inner: StorageBackend,
        config: QuotaConfig,
        *,
        ledger: QuotaLedger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(inner)
        self.config = config
        self._ledger = ledger if ledger is not None else _open(config, inner)
        self._clock = clock
        self._lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self._flushed = clock()
        self._counts: Counter[str] = Counter()

    # -- writes ---------------------------------------------------------------------------------

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``key`` within the quota (evicting the namespace's oldest pages if needed)."""
        size = as_readable(value).nbytes
        return self._write([(key, size)], lambda _: [self.inner.set(key, value)])[0]

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store the pages that fit within the quota; the rest of the batch is shed."""
        sizes = [(key, as_readable(value).nbytes) for key, value in zip(keys, values, strict=True)]
        return self._write(
            sizes,
            lambda picked: self.inner.batch_set(
                [keys[i] for i in picked], [values[i] for i in picked]
            ),
        )

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store the pool's pages that fit within the quota; the rest of the batch is shed."""
        pool = self.inner.host_pool
        step = pool.page_size
        sizes = [(key, pool.page_nbytes) for key in keys]
        return self._write(
            sizes,
            lambda picked: self.inner.batch_set_v1(
                [keys[i] for i in picked], _pick_pages(host_indices, picked, step)
            ),
        )

    def _write(
        self, sizes: list[tuple[str, int]], write: Callable[[list[int]], list[bool]]
    ) -> list[bool]:
        """Reserve room for the leading pages that can fit, evict, write them, settle.

        ``write`` stores the pages at the positions it is given: each key's last position
        among the leading ones, so a repeated key is written and counted once.
        """
        quota = self.config.bytes
        last: dict[str, int] = {}  # each key's last position among those that fit
        fit, total = 0, 0
        for i, (key, size) in enumerate(sizes):
            replaced = sizes[last[key]][1] if key in last else 0
            if total - replaced + size > quota:
                break
            last[key] = i
            fit, total = i + 1, total - replaced + size
        shed = len(sizes) - fit
        grant = self._reserve(total) if fit else None
        if grant is None:
            self._count(shed_pages=len(sizes))
            return [False] * len(sizes)
        picked = sorted(last.values())
        try:
            self._evict(grant)
            stored = dict(zip(picked, write(picked), strict=True))
        except BaseException:
            self._ledger.release(grant.hold)
            raise
        self._ledger.settle(grant.hold, [sizes[i] for i in picked if stored[i]], now=self._clock())
        self._count(shed_pages=shed, stored_pages=sum(stored.values()))
        return [stored[last[key]] for key, _ in sizes[:fit]] + [False] * shed

    def _reserve(self, total: int) -> Grant | None:
        """Reserve ``total`` bytes, waiting up to :data:`_ROOM_WAIT_S` for room in flight."""
        deadline = time.monotonic() + _ROOM_WAIT_S
        pause = 0.001
        while True:
            grant = self._ledger.reserve(
                total,
                quota=self.config.bytes,
                target=int(self.config.bytes * self.config.low_watermark),
                now=self._clock(),
                hold_s=self.config.hold_s,
                touched=self._take_touches(),
            )
            if grant is not None or time.monotonic() + pause > deadline:
                return grant
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _evict(self, grant: Grant) -> None:
        """Delete the grant's victims; any that could not be deleted go back to the ledger."""
        if grant.evicting is None:
            return
        kept: list[tuple[str, int]] = []
        for key, size in grant.victims:
            try:
                self.inner.delete(key)
            except BackendError:
                kept.append((key, size))
        self._ledger.settle(grant.evicting, kept, now=self._clock())
        self._count(evicted_pages=len(grant.victims) - len(kept), evict_failed=len(kept))
        if kept:
            raise _eviction_error(len(kept))

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Forward ``get``; a hit marks the page used."""
        value = self.inner.get(key, out)
        if value is not None:
            self._touch([key])
        return value

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Forward ``batch_get``; hits mark their pages used."""
        hits = self.inner.batch_get(keys, outs)
        self._touch([key for key, hit in zip(keys, hits, strict=False) if hit])
        return hits

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Forward ``batch_get_v1``; hits mark their pages used."""
        hits = self.inner.batch_get_v1(keys, host_indices)
        self._touch([key for key, hit in zip(keys, hits, strict=False) if hit])
        return hits

    def _touch(self, keys: list[str]) -> None:
        """Remember ``keys`` as used now; write the gathered reads when they are many or old."""
        if not keys:
            return
        now = self._clock()
        with self._lock:
            for key in keys:
                self._touched[key] = now
            due = len(self._touched) >= _TOUCHES_PER_FLUSH or now - self._flushed >= _TOUCH_FLUSH_S
        if due:
            touched = self._take_touches()
            try:
                self._ledger.touch(touched)
            except BackendError:  # the reads were served; their order waits for the next write
                self._count(touch_failed=len(touched))

    def _take_touches(self) -> list[tuple[str, float]]:
        with self._lock:
            touched, self._touched = list(self._touched.items()), {}
            self._flushed = self._clock()
        return touched

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Take ``key`` out of the ledger, then delete it (back in the ledger if that fails).

        In this order a write of ``key`` racing the delete, in any process, settles after the
        forget: the ledger may count a page the delete then removed, never miss a stored one.
        """
        forgotten = self._ledger.forget([key])
        try:
            return self.inner.delete(key)
        except BaseException:
            self._ledger.settle(_NO_HOLD, forgotten, now=self._clock())
            raise

    def clear(self) -> None:
        """Take the namespace's pages out of the ledger, then clear the namespace.

        In this order a write racing the clear, in any process, settles after the ledger was
        cleared: the ledger may count a page the clear then removed, never miss a stored one.
        A clear that fails partway leaves the pages it did not remove uncounted until one
        succeeds.
        """
        self._ledger.clear()
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        """Add ``quota`` (the ledger's figures and this process's counts) and its capacity."""
        stats = self.inner.stats()
        with self._lock:
            counts = dict(self._counts)
        section: dict[str, Any] = {"bytes": self.config.bytes, **counts}
        try:
            usage = self._ledger.usage(now=self._clock())
        except BackendError as exc:
            section["error"] = str(exc)
        else:
            section.update(
                used_bytes=usage.used_bytes, held_bytes=usage.held_bytes, pages=usage.pages
            )
            if "capacity" in stats:
                stats["store_capacity"] = stats["capacity"]
            stats["capacity"] = Capacity(
                scope="namespace",
                used_bytes=usage.used_bytes + usage.held_bytes,
                bound_bytes=self.config.bytes,
                evictions=counts.get("evicted_pages", 0),
                policy="lru",
            )
        stats["quota"] = section
        return stats

    def close(self) -> None:
        """Write the gathered reads (if the ledger answers), close the ledger and the backend."""
        if self.closed:
            return
        try:
            self._ledger.touch(self._take_touches())
        except BackendError:
            pass
        finally:
            self._ledger.close()
            self.inner.close()

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                if n:
                    self._counts[name] += n


def _pick_pages(
    host_indices: torch.Tensor | Sequence[int], picked: list[int], step: int
) -> torch.Tensor | Sequence[int]:
    """Return the host indices of the pages at positions ``picked`` (``step`` indices a page)."""
    if picked == list(range(len(picked))):
        return host_indices[: len(picked) * step]
    if isinstance(host_indices, Sequence):
        return [int(j) for i in picked for j in host_indices[i * step : (i + 1) * step]]
    import torch

    return torch.cat([host_indices[i * step : (i + 1) * step] for i in picked])


def _eviction_error(n: int) -> BackendError:
    return BackendIOError(f"quota: {n} pages chosen for eviction could not be deleted")


def _open(config: QuotaConfig, inner: StorageBackend) -> QuotaLedger:
    """Open the ledger ``config`` names, else the one the backend's store keeps."""
    if config.ledger is not None:
        from ..quota import open_ledger

        return open_ledger(config.ledger, config.namespace)
    base = inner.unwrap() if isinstance(inner, ForwardingBackend) else inner
    ledger = base.quota_ledger()
    if ledger is None:
        raise ConfigError(
            f"backend {base.name!r} keeps no shared quota ledger: set layers.quota.ledger to "
            "an SQLite file on a file system every writer mounts, or to a redis:// URL with "
            "layers.quota.namespace"
        )
    return ledger
