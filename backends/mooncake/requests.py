"""Requests to the Mooncake store within a call's deadline, failures counted by reason.

A call of :class:`~.backend.MooncakeBackend` starts a library request only while its deadline
leaves room for that request's worst case (:meth:`Requests.run_groups`), sends a request the
master's reset connection failed again, and copies values through the client's registered
staging buffer where they cannot move in place (:meth:`Requests.staged_put`,
:meth:`Requests.staged_get`). Every failure is counted by its reason for ``stats()``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from hicache_storage.errors import BackendTimeoutError
from hicache_storage.kit import Deadline

from .client import (
    NO_SPACE,
    NOT_FOUND,
    RPC_FAIL,
    SKIPPED,
    UNCONFIRMED,
    UNREACHABLE,
    Request,
    SharedClient,
    code_name,
)

__all__ = ["RPC_FAIL_RESENDS", "Requests", "pick", "unique_rounds"]

T = TypeVar("T")

_STORED = (0, -705)
"""``put`` answers meaning the key holds a complete value (new, or already there)."""
_EXISTS = -705
_INVALID_PARAMS = -600
_TRANSFER_FAIL = -800

RPC_FAIL_RESENDS = 16
"""How often a request that failed whole with ``RPC_FAIL`` is sent again (while the deadline has
room): the client library pools master connections per process, and after a master restart each
pooled connection fails once, at once ("End of file"). A process that opened many instances holds
many (seen: four in a row after the conformance suite's close races), so a few resends were not
enough; each costs microseconds."""


def unique_rounds(names: Sequence[str]) -> list[list[int]]:
    """Split item indices into rounds in which no key repeats (in order).

    Mooncake's batch calls answer a key named twice in one batch only once: the second
    destination is reported filled but is not. A repeated key goes in a later round instead.
    """
    rounds: list[list[int]] = []
    seen: list[set[str]] = []
    for index, name in enumerate(names):
        for members, keys in zip(rounds, seen, strict=True):
            if name not in keys:
                members.append(index)
                keys.add(name)
                break
        else:
            rounds.append([index])
            seen.append({name})
    return rounds


def pick(items: Sequence[T], indices: Sequence[int]) -> list[T]:
    """Return the items at ``indices``, in their order."""
    return [items[i] for i in indices]


class Requests:
    """The library requests of one backend instance over ``client``, and its failure counts."""

    def __init__(self, client: SharedClient) -> None:
        self._client = client
        self._timeouts = client.timeouts
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._moved: Counter[str] = Counter()

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Return copies of the failure counts and the bytes moved."""
        with self._lock:
            return dict(self._errors), dict(self._moved)

    def count(self, reason: str, n: int = 1) -> None:
        """Count ``n`` failures of ``reason``."""
        with self._lock:
            self._errors[reason] += n

    def tally(self, what: str, n: int) -> None:
        """Count ``n`` bytes moved by path ``what``."""
        with self._lock:
            self._moved[what] += n

    def begin(self) -> Deadline:
        """Start the call's deadline."""
        return Deadline(self._timeouts.deadline_s)

    def meta(self, deadline: Deadline, what: str, ask: Callable[[], int]) -> int:
        """Run one metadata request (no caller memory involved) within the call's deadline.

        Raises
        ------
        BackendTimeoutError
            If the deadline leaves no room for it.
        BackendUnavailableError
            If the master is known to be down or does not answer.
        """
        if not deadline.allows(self._timeouts.cost("meta")):
            self.count(code_name(SKIPPED))
            raise BackendTimeoutError(
                f"mooncake {what}: deadline_s={self._timeouts.deadline_s:g}s left no room"
            )
        client = self._client
        with client.call(what, self.count):
            code = int(ask())
        resent = 0
        while (
            code == RPC_FAIL
            and resent < RPC_FAIL_RESENDS
            and deadline.allows(self._timeouts.cost("meta"))
        ):
            resent += 1
            with client.call(what, self.count):  # again: a connection the master reset
                code = int(ask())
        return client.check(code, what, self.count)

    def hits(
        self,
        codes: Sequence[int],
        sizes: Sequence[int],
        keys: Sequence[str],
        deadline: Deadline,
    ) -> list[bool]:
        """Turn ``batch_get_into*`` answers into hits, counting each failure by its reason."""
        hits = []
        unclear = []
        for code, size, key in zip(codes, sizes, keys, strict=True):
            if code == size:
                hits.append(True)
                continue
            hits.append(False)
            if code == _TRANSFER_FAIL:
                unclear.append((key, size))
            elif code == _INVALID_PARAMS:
                self.count("size_mismatch")
            elif code >= 0:
                self.count("short_read")
            elif code != NOT_FOUND:
                self.count(code_name(code))
        for key, size in unclear:  # smaller than the destination, or a failed transfer?
            self.count(
                "size_mismatch" if self._size_differs(key, size, deadline) else "TRANSFER_FAIL"
            )
        return hits

    def _size_differs(self, name: str, size: int, deadline: Deadline) -> bool:
        """Return whether the object ``name`` exists with a size other than ``size``.

        Asked only for counting; never when the deadline or the breaker says not to.
        """
        client = self._client
        if client.down or not deadline.allows(self._timeouts.cost("meta")):
            return False
        try:
            actual = int(client.store.get_size(name))
        except Exception:  # noqa: BLE001 - a count, not an answer to the caller
            return False
        if actual in UNREACHABLE:
            client.mark_down(actual)
        return actual >= 0 and actual != size

    def stored(self, codes: Sequence[int]) -> list[bool]:
        """Turn ``put`` answers into stored flags, counting each failure by its reason."""
        results = []
        for code in codes:
            results.append(code in _STORED)
            if code not in _STORED:
                self.count(code_name(code))
                if code == NO_SPACE:
                    self._client.note_no_space()
        return results

    def run_groups(
        self,
        groups: Sequence[Sequence[int]],
        size: int,
        request: Request,
        deadline: Deadline,
        run: Callable[[Sequence[int]], Sequence[int]],
    ) -> list[int]:
        """Run ``run(group)`` (one library request per group) while the deadline has room.

        Returns one code per item: the request's answer, ``SKIPPED`` for a group the deadline
        left no room for, and, once a group found the master unreachable, that code for every
        later group (they are not sent). A group whose transfers failed only after waiting out
        the transfer timeout (a segment peer that stopped answering) ends the call too: its
        later groups are ``SKIPPED`` rather than each waiting again.

        A group whose every key failed with ``RPC_FAIL`` is sent again (up to
        :data:`RPC_FAIL_RESENDS` times) while the deadline has room: the first request on each
        pooled connection after a master restart fails on the connection the old master closed
        (at once, "End of file"), and the library does not retry. Such a request moved no byte (the
        replica query or the put's start failed); a put sent again that finds the object
        already there is ``UNCONFIRMED`` (not stored), as it may be the first attempt's.
        """
        codes = [SKIPPED] * size
        cost = self._timeouts.cost(request)
        failed: int | None = None
        stalled = False
        for group in groups:
            if failed is not None:
                for index in group:
                    codes[index] = failed
                continue
            if stalled or not deadline.allows(cost):
                continue
            started = time.monotonic()
            got = run(group)
            resent = 0
            while (
                got
                and all(code == RPC_FAIL for code in got)
                and resent < RPC_FAIL_RESENDS
                and deadline.allows(cost)
            ):
                resent += 1
                got = run(group)
                if request == "put":
                    got = [UNCONFIRMED if code == _EXISTS else code for code in got]
            for index, code in zip(group, got, strict=True):
                codes[index] = code
            failed = next((code for code in got if code in UNREACHABLE), None)
            stalled = _TRANSFER_FAIL in got and (
                time.monotonic() - started >= self._timeouts.transfer_s
            )
        return codes

    def _chunks(self, sizes: Sequence[int]) -> list[list[int]]:
        """Group item indices so each group fits the staging buffer (oversized ones alone)."""
        capacity = self._client.staging.nbytes
        groups: list[list[int]] = []
        current: list[int] = []
        used = 0
        for index, size in enumerate(sizes):
            if size > capacity:
                groups.append([index])
                continue
            if used + size > capacity:
                groups.append(current)
                current, used = [], 0
            current.append(index)
            used += size
        if current:
            groups.append(current)
        return groups

    def _staged(
        self,
        names: Sequence[str],
        views: Sequence[memoryview],
        request: Request,
        deadline: Deadline,
        move: Callable[[list[str], list[int], list[int], np.ndarray[Any, Any], int], list[int]],
    ) -> list[int]:
        """Run ``move`` over chunks that fit the staging buffer; return per-item codes.

        The staging buffer is shared by the client's calls: waiting for it counts against the
        deadline, and items it leaves no room for are ``SKIPPED``.
        """
        client = self._client
        sizes = [view.nbytes for view in views]
        groups = [
            [members[i] for i in group]
            for members in unique_rounds(names)
            for group in self._chunks(pick(sizes, members))
        ]

        def run(group: Sequence[int]) -> list[int]:
            group_sizes = [sizes[i] for i in group]
            group_names = [names[i] for i in group]
            if sum(group_sizes) > client.staging.nbytes:
                with client.temporary(group_sizes[0]) as (buffer, ptr):
                    return move(group_names, list(group), group_sizes, buffer, ptr)
            return move(group_names, list(group), group_sizes, client.staging, client.staging_ptr)

        wait = deadline.left() - self._timeouts.cost(request)
        if not groups or not client.staging_lock.acquire(timeout=max(wait, 0.0)):
            return [SKIPPED] * len(names)
        try:
            return self.run_groups(groups, len(names), request, deadline, run)
        finally:
            client.staging_lock.release()

    def staged_put(
        self, names: list[str], views: list[memoryview], deadline: Deadline
    ) -> list[bool]:
        """Put ``views`` under ``names`` through the staging buffer; per name, whether stored."""
        client = self._client
        present = [i for i, view in enumerate(views) if view.nbytes]
        if len(present) < len(views):
            self.count("empty_value", len(views) - len(present))

        def put(
            group_names: list[str],
            group: list[int],
            group_sizes: list[int],
            buffer: np.ndarray[Any, Any],
            ptr: int,
        ) -> list[int]:
            offsets = []
            offset = 0
            for index, size in zip(group, group_sizes, strict=True):
                buffer[offset : offset + size] = np.frombuffer(chosen[index], dtype=np.uint8)
                offsets.append(ptr + offset)
                offset += size
            with client.call("batch_put_from", self.count):
                got = client.store.batch_put_from(group_names, offsets, group_sizes)
                return [int(code) for code in got]

        chosen = [views[i] for i in present]
        codes = self._staged([names[i] for i in present], chosen, "put", deadline, put)
        client.check_batch(codes, "batch_put_from", self.count)
        stored = [False] * len(views)
        for index, ok in zip(present, self.stored(codes), strict=True):
            stored[index] = ok
        self.tally("bytes_staged", sum(view.nbytes for view in chosen))
        return stored

    def staged_get(
        self, names: list[str], views: list[memoryview], deadline: Deadline
    ) -> list[bool]:
        """Get ``names`` into ``views`` through the staging buffer; per name, whether a hit."""
        client = self._client
        present = [i for i, view in enumerate(views) if view.nbytes]
        chosen = [views[i] for i in present]

        def get(
            group_names: list[str],
            group: list[int],
            group_sizes: list[int],
            buffer: np.ndarray[Any, Any],
            ptr: int,
        ) -> list[int]:
            offsets = []
            offset = 0
            for size in group_sizes:
                offsets.append(offset)
                offset += size
            with client.call("batch_get_into_multi_buffers", self.count):
                got = [
                    int(code)
                    for code in client.store.batch_get_into_multi_buffers(
                        group_names, [[ptr + o] for o in offsets], [[s] for s in group_sizes]
                    )
                ]
            for index, start, size, code in zip(group, offsets, group_sizes, got, strict=True):
                if code == size:
                    dst = np.frombuffer(chosen[index], dtype=np.uint8)
                    dst[:] = buffer[start : start + size]
            return got

        codes = self._staged([names[i] for i in present], chosen, "get", deadline, get)
        client.check_batch(codes, "batch_get_into_multi_buffers", self.count)
        hits = [False] * len(views)
        answers = self.hits(codes, [view.nbytes for view in chosen], pick(names, present), deadline)
        for index, hit in zip(present, answers, strict=True):
            hits[index] = hit
        self.tally("bytes_staged", sum(v.nbytes for v, h in zip(views, hits, strict=True) if h))
        return hits
