"""Pages verified end to end: a page whose bytes are not the ones written for its key is a miss.

A backend's answer is not proof: a ``True`` from ``batch_get_v1`` may come with slots it never
filled (a completion lost by an RDMA transport, a late or broken third-party backend), or with
another key's bytes. This layer checks every page that reaches the caller against a record its
writer made, whatever the backend answered:

* ``batch_set_v1`` stores, for each page the backend stored, an integrity record
  (:mod:`hicache_storage.kit.integrity`: the page's length, its CRC32C and a digest of its key),
  as a small object of its own under :func:`record_key` ``(key)``, checksummed while the backend
  writes the pages. A page whose record cannot be stored is reported not stored.
* ``batch_get_v1`` reads the pages' records while the backend reads the pages (one more round
  trip would add its latency to every fetch), then checks each page the backend reported as a
  hit against its record, in the caller's slots. A page without a record, or whose bytes
  do not match, is a miss (counted under ``stats()["verify"]``); a mismatched page and its record
  are deleted where the backend can delete, and its key is distrusted in this process
  (``exists``/``batch_exists`` stop before it) until it is stored again.

The page objects themselves are unchanged, so stores stay shareable with readers of the same
keys; records are the only extra objects (one per page, of
:data:`~hicache_storage.kit.integrity.RECORD_BYTES`). A backend claiming ``foreign_names`` lays
its store out exactly as another system does (the file backend's names shared with SGLang's own
file backend, which neither writes nor reads records): over it the layer writes no records and
passes hits through, counted ``unverified``.
Only the page calls are verified; ``get``/``set`` move values the caller checks itself.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from hicache_storage.errors import BackendError
from hicache_storage.kit.integrity import RECORD_BYTES, seal, verify
from hicache_storage.kit.parallel import Beside, IOWorkers

from .base import ForwardingBackend

if TYPE_CHECKING:
    import torch

    from ..backend import StorageBackend

__all__ = ["DISTRUSTED_KEYS", "RECORD_PREFIX", "VerifyLayer", "record_key"]

DISTRUSTED_KEYS: Final = 65536
"""Keys a process remembers as distrusted (oldest forgotten first): a bound on memory, a few MB,
well above the pages one engine's host pool holds."""

RECORD_PREFIX: Final = "hcv-"
"""How every record's key begins (then a 40-digit hex digest of the page's key)."""


CHECKSUM_THREADS: Final = min(16, os.cpu_count() or 1)
"""Pages checksummed at once: CRC32C releases the GIL on large buffers, so the pages of a batch
are summed in parallel, on as many threads as cores (at most the sixteen that saturate a host's
memory bandwidth, see :mod:`hicache_storage.kit.parallel`)."""


def record_key(key: str) -> str:
    """Return the key of ``key``'s integrity record (fixed length, so any valid key has one)."""
    return RECORD_PREFIX + hashlib.blake2b(key.encode(), digest_size=20).hexdigest()


class VerifyLayer(ForwardingBackend):
    """Check every page a v1 read answers as a hit against the record written with it."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self._foreign = inner.capabilities.foreign_names
        self._lock = threading.Lock()
        self._distrusted: OrderedDict[str, None] = OrderedDict()
        self._counts = dict.fromkeys(
            ("verified", "mismatched", "no_record", "unverified", "records_failed"), 0
        )
        self._workers = IOWorkers(CHECKSUM_THREADS, "hicache-verify")

    # -- writes -----------------------------------------------------------------------------------

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store the pages, then a record of each stored page; a page without one is not stored.

        The pages are checksummed while the backend writes them (both only read the slots).
        """
        if self._foreign:
            return self.inner.batch_set_v1(keys, host_indices)
        views = self.inner.host_pool.page_buffer_views(host_indices)
        sealing = Beside(
            self._workers.map,
            lambda i: seal(keys[i], views[i]),
            range(len(keys)),
            name="hicache-verify-beside",
        )
        try:
            stored = list(self.inner.batch_set_v1(keys, host_indices))
        finally:
            sealed = sealing.result()
        chosen = [i for i, ok in enumerate(stored) if ok]
        if not chosen:
            return stored
        try:
            written = self.inner.batch_set(
                [record_key(keys[i]) for i in chosen], [sealed[i] for i in chosen]
            )
        except BackendError:
            written = [False] * len(chosen)
        failed = 0
        with self._lock:
            for i, ok in zip(chosen, written, strict=True):
                if ok:
                    self._distrusted.pop(keys[i], None)
                else:
                    stored[i] = False
                    failed += 1
            self._counts["records_failed"] += failed
        return stored

    # -- reads ------------------------------------------------------------------------------------

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read the pages; keep as hits only those whose bytes match their record.

        The records are fetched while the backend reads the pages; the pages' checksums follow.
        """
        if self._foreign:
            hits = self.inner.batch_get_v1(keys, host_indices)
            with self._lock:
                self._counts["unverified"] += sum(hits)
            return hits
        with self._lock:
            trusted = [i for i in range(len(keys)) if keys[i] not in self._distrusted]
        records = [bytearray(RECORD_BYTES) for _ in trusted]
        fetching = Beside(
            self.inner.batch_get,
            [record_key(keys[i]) for i in trusted],
            records,
            name="hicache-verify-beside",
        )
        try:
            hits = list(self.inner.batch_get_v1(keys, host_indices))
        finally:
            try:
                found_all = fetching.result()
            except BackendError:
                found_all = [False] * len(trusted)
        fetched = {
            i: record for i, has, record in zip(trusted, found_all, records, strict=True) if has
        }
        answered = [i for i, hit in enumerate(hits) if hit]
        chosen = [i for i in answered if i in fetched]
        # Distrusted keys and pages without a record are misses, whatever the backend says.
        trusted_set = set(trusted)
        unrecorded = sum(1 for i in answered if i in trusted_set and i not in fetched)
        for i in set(answered) - set(chosen):
            hits[i] = False
        if not chosen:
            with self._lock:
                self._counts["no_record"] += unrecorded
            return hits
        views = self.inner.host_pool.page_buffer_views(host_indices)
        problems = self._workers.map(lambda i: verify(fetched[i], keys[i], views[i]), chosen)
        outcome = {"verified": 0, "mismatched": 0, "no_record": unrecorded}
        bad: list[str] = []
        for i, problem in zip(chosen, problems, strict=True):
            if problem is None:
                outcome["verified"] += 1
            else:
                outcome["mismatched"] += 1
                hits[i] = False
                bad.append(keys[i])
        with self._lock:
            for name, count in outcome.items():
                self._counts[name] += count
            for key in bad:
                self._distrusted[key] = None
                self._distrusted.move_to_end(key)
            while len(self._distrusted) > DISTRUSTED_KEYS:
                self._distrusted.popitem(last=False)
        for key in bad:
            self._forget(key)
        return hits

    def exists(self, key: str) -> bool:
        """Return False for a distrusted key; else ask the backend."""
        with self._lock:
            if key in self._distrusted:
                return False
        return self.inner.exists(key)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the backend's leading-hit count, cut before the first distrusted key."""
        found = self.inner.batch_exists(keys)
        with self._lock:
            if not self._distrusted:
                return found
            for i in range(found):
                if keys[i] in self._distrusted:
                    return i
        return found

    # -- housekeeping -----------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Delete ``key``'s record, then the page (whether the page existed).

        A deleted or evicted page (the quota layer evicts through here) takes its record with
        it, so records do not pile up beside a bounded namespace. Record first: a delete that
        fails halfway leaves a page without a record (a miss), not a record without a page.
        """
        if not self._foreign:
            self.inner.delete(record_key(key))
        return self.inner.delete(key)

    def stats(self) -> dict[str, Any]:
        """Return the inner stats with this layer's counts under ``verify``."""
        with self._lock:
            counts = {**self._counts, "distrusted": len(self._distrusted)}
        return {**self.inner.stats(), "verify": counts}

    def close(self) -> None:
        """Close the inner backend, then stop the checksum threads."""
        try:
            self.inner.close()
        finally:
            self._workers.close()

    def _forget(self, key: str) -> None:
        """Delete a page that failed verification, and its record, where the backend can."""
        if not self.capabilities.delete:
            return
        for name in (key, record_key(key)):
            try:
                self.inner.delete(name)
            except BackendError:
                return
