"""The Mooncake store backend: KV pages in a Mooncake distributed store, moved zero-copy.

Keys
    ``<prefix>/<key>`` (``<key>`` alone with no prefix). Keys never contain '/', and a prefix is
    segments of the key alphabet joined by '/', so each stored name belongs to exactly one
    namespace; ``clear()`` removes the names ``<prefix>/<rest>`` whose ``<rest>`` has no '/'
    (with no prefix: the names without '/').

Deadlines
    Every call gets ``deadline_s``. The client library's own timeouts are derived from it (see
    :mod:`.client`), so each store request returns by itself, after the transfers it started
    have ended; a call starts a request only while its deadline leaves room for that request's
    worst case, and items it could not start are misses (``False`` for writes). After a request
    finds the master unreachable, calls fail at once until a background probe reaches it again.

Zero-copy (``batch_set_v1`` / ``batch_get_v1``)
    The host pool's whole tensor is registered with the store once, by
    :meth:`MooncakeBackend.register_host_pool`. Every page then moves in one batch call,
    ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, handed the address and
    size of each of the page's buffers (:meth:`HostPool.page_buffer_meta`: two for MHA
    page-first layouts, ``2L`` or ``L`` for layer_first, one for MLA page-first): Mooncake reads
    and writes the pool in place, with no intermediate copy. An object whose size differs from
    the page is refused by Mooncake before any byte moves (``INVALID_PARAMS`` when larger,
    ``TRANSFER_FAIL`` when smaller), so a miss never touches the page.

Copying calls (``get`` / ``set`` / ``batch_*``)
    Arbitrary caller buffers cannot be registered (Mooncake refuses overlapping regions and RDMA
    needs registered memory), so these copy once through the client's registered staging buffer
    (``local_buffer_size``), in chunks that fit it, under a lock; a value larger than the whole
    buffer gets a temporary registered buffer of its own.

Return codes
    ``OBJECT_NOT_FOUND`` is a miss. Codes that mean the master did not answer (``RPC_FAIL``,
    ``RPC_TIMEOUT``) raise :class:`~hicache_storage.errors.BackendUnavailableError` when no key
    got an answer. Every other negative code is a miss or ``False`` for its key, counted by name
    in ``stats()["errors"]``.

Closing
    ``close()`` refuses new calls at once and unregisters the host pool only once the calls in
    flight, and so the transfers they started, have ended
    (:func:`~hicache_storage.kit.closed_guard`, waiting up to ``deadline_s``).

Semantics
    A duplicate ``put`` keeps the first value (first writer wins). Objects live in the segments
    mounted by processes that contribute one (``global_segment_size > 0``) and are dropped when
    that process's client closes; run long-lived segment holders (``mooncake_client``) for data
    that must outlive the writers. Only a pure client (``global_segment_size=0``, the default)
    claims ``persistent`` and ``shared``.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from typing_extensions import Buffer

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.capabilities import Capabilities
from hicache_storage.capacity import Capacity
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendIOError,
    BackendTimeoutError,
    BufferSizeError,
    IndexAlignmentError,
    InvalidKeyError,
)
from hicache_storage.kit import Deadline, closed_guard

from .client import (
    NO_SPACE,
    NOT_FOUND,
    RPC_FAIL,
    SKIPPED,
    UNCONFIRMED,
    UNREACHABLE,
    Request,
    SharedClient,
    acquire,
    code_name,
)
from .config import MooncakeConfig, MooncakeSettings, capabilities

if TYPE_CHECKING:
    import torch

__all__ = ["MooncakeBackend", "capabilities_for", "clear_pattern", "unique_rounds"]

T = TypeVar("T")

_STORED = (0, -705)
"""``put`` answers meaning the key holds a complete value (new, or already there)."""
_EXISTS = -705
_NOT_READY = -703
_INVALID_PARAMS = -600
_TRANSFER_FAIL = -800
_REGEX_SPECIAL = frozenset(".^$|?*+()[]{}\\")


def clear_pattern(prefix: str) -> str:
    """Return the regex (ECMAScript, searched) of the names in the namespace ``prefix``.

    ``prefix`` is normalized (no trailing '/'). The names are ``<prefix>/<key>`` with no '/' in
    ``<key>``, or, for the empty prefix, the names without '/': never a longer prefix's names
    (``ten2/k``, ``ten/sub/k``).
    """
    if not prefix:
        return "^[^/]+$"
    escaped = "".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in prefix)
    return f"^{escaped}/[^/]+$"


def capabilities_for(settings: MooncakeSettings) -> Capabilities:
    """Return what an instance with ``settings`` can promise (:func:`.config.capabilities`)."""
    return capabilities(settings.global_segment_size)


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


RPC_FAIL_RESENDS = 16
"""How often a request that failed whole with ``RPC_FAIL`` is sent again (while the deadline has
room): the client library pools master connections per process, and after a master restart each
pooled connection fails once, at once ("End of file"). A process that opened many instances holds
many (seen: four in a row after the conformance suite's close races), so a few resends were not
enough; each costs microseconds."""

MAX_CALL_BUFFERS = 512
"""Most page buffers one multi-buffer request carries. The library queues every buffer's
transfer at once; measured with 0.3.13 on one host, pages of 800 buffers moved, 1,200 failed in
part (``TRANSFER_FAIL`` once about 2,048 were queued) and 2,070 stalled 60 s, past any deadline,
after which every put failed. A page with more buffers than this goes through the staging buffer
(one contiguous object, scattered in the pool)."""


def buffer_groups(rounds: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[int]]:
    """Split each round into groups of at most :data:`MAX_CALL_BUFFERS` buffers (in order).

    An item with more buffers than that is a group of its own; the caller stages those.
    """
    groups: list[list[int]] = []
    for members in rounds:
        group: list[int] = []
        total = 0
        for index in members:
            if group and total + counts[index] > MAX_CALL_BUFFERS:
                groups.append(group)
                group, total = [], 0
            group.append(index)
            total += counts[index]
        if group:
            groups.append(group)
    return groups


def _pick(items: Sequence[T], indices: Sequence[int]) -> list[T]:
    return [items[i] for i in indices]


@closed_guard
class MooncakeBackend(StorageBackend):
    """Stores each key as one object in a Mooncake store; see the module docstring.

    Parameters
    ----------
    config
        The backend's options; connection settings not given fall back to a JSON file and the
        ``MOONCAKE_*`` environment variables.
    deployment
        The rank this instance serves (kept for the key scheme; the store is shared by all).

    Raises
    ------
    ConfigError
        If no master address is configured or a setting is malformed.
    BackendUnavailableError
        If the master does not accept connections within ``probe_timeout_s``, or ``setup``
        fails.
    MissingDependencyError
        If the mooncake client library is not installed.
    """

    name = "mooncake"

    def __init__(self, config: MooncakeConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.config = config
        self.deployment = deployment if deployment is not None else Deployment()
        self.settings = config.resolve()
        self.capabilities = capabilities_for(self.settings)
        self._prefix = self.settings.prefix
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._moved: Counter[str] = Counter()
        self._region: int | None = None
        self._client: SharedClient = acquire(self.settings)
        self._timeouts = self._client.timeouts

    # -- bookkeeping ----------------------------------------------------------------------------

    def _count(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._errors[reason] += n

    def _tally(self, what: str, n: int) -> None:
        with self._lock:
            self._moved[what] += n

    @property
    def close_timeout_s(self) -> float:
        """How long ``close()`` waits for calls in flight (and their transfers): ``deadline_s``."""
        return self._timeouts.deadline_s

    def _begin(self) -> Deadline:
        """Start the call's deadline."""
        return Deadline(self._timeouts.deadline_s)

    def _keys(self, keys: Sequence[str]) -> list[str]:
        """Return the stored names of ``keys``: ``<prefix>/<key>``, or ``<key>`` with no prefix.

        Raises
        ------
        InvalidKeyError
            If a key contains '/', which would let it name an object of another namespace (the
            validation layer refuses such keys before they get here).
        """
        for key in keys:
            if "/" in key:
                raise InvalidKeyError(
                    f"invalid key {key[:80]!r}: it contains '/', which separates namespaces"
                )
        prefix = self._prefix
        return [f"{prefix}/{key}" for key in keys] if prefix else list(keys)

    def _meta(self, deadline: Deadline, what: str, ask: Callable[[], int]) -> int:
        """Run one metadata request (no caller memory involved) within the call's deadline.

        Raises
        ------
        BackendTimeoutError
            If the deadline leaves no room for it.
        BackendUnavailableError
            If the master is known to be down or does not answer.
        """
        if not deadline.allows(self._timeouts.cost("meta")):
            self._count(code_name(SKIPPED))
            raise BackendTimeoutError(
                f"mooncake {what}: deadline_s={self._timeouts.deadline_s:g}s left no room"
            )
        client = self._client
        with client.call(what, self._count):
            code = int(ask())
        resent = 0
        while (
            code == RPC_FAIL
            and resent < RPC_FAIL_RESENDS
            and deadline.allows(self._timeouts.cost("meta"))
        ):
            resent += 1
            with client.call(what, self._count):  # again: a connection the master reset
                code = int(ask())
        return client.check(code, what, self._count)

    def _hits(
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
                self._count("size_mismatch")
            elif code >= 0:
                self._count("short_read")
            elif code != NOT_FOUND:
                self._count(code_name(code))
        for key, size in unclear:  # smaller than the destination, or a failed transfer?
            self._count(
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

    def _stored(self, codes: Sequence[int]) -> list[bool]:
        results = []
        for code in codes:
            results.append(code in _STORED)
            if code not in _STORED:
                self._count(code_name(code))
                if code == NO_SPACE:
                    self._client.note_no_space()
        return results

    def _run_groups(
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

    # -- the contract ---------------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value of ``key`` (a ``bytearray``), or read it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the object's size (``out`` is left untouched).
        BackendUnavailableError
            If the master does not answer.
        BackendTimeoutError
            If the deadline passed before the value could be read.
        """
        deadline = self._begin()
        name = self._keys([key])[0]
        size = self._meta(deadline, "get_size", lambda: self._client.store.get_size(name))
        if size < 0:
            if size not in (NOT_FOUND, _NOT_READY):
                self._count(code_name(size))
            return None
        value = bytearray(size) if out is None else None
        view = memoryview(value) if value is not None else as_writable(out)
        if view.nbytes != size:
            raise BufferSizeError(
                f"output buffer has {view.nbytes} bytes but the object stored under {key!r} "
                f"has {size}"
            )
        if not self._staged_get([name], [view], deadline)[0]:
            return None
        return value if value is not None else out

    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds a complete value."""
        deadline = self._begin()
        name = self._keys([key])[0]
        code = self._meta(deadline, "is_exist", lambda: self._client.store.is_exist(name))
        if code < 0:
            self._count(code_name(code))
        return code == 1

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds one already (the first value wins).

        Returns False when the store refuses the value (empty, no space): the reason is
        counted in ``stats()``.
        """
        deadline = self._begin()
        return self._staged_put(self._keys([key]), [as_readable(value)], deadline)[0]

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its output buffer; an object of another size is a miss."""
        deadline = self._begin()
        views = [as_writable(out) for out in outs]
        return self._staged_get(self._keys(keys), views, deadline)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key; return per key whether it now holds a value."""
        deadline = self._begin()
        views = [as_readable(value) for value in values]
        return self._staged_put(self._keys(keys), views, deadline)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist (one ``batch_is_exist``)."""
        # One request, the first: always within the deadline.
        if not keys:
            return 0
        client = self._client
        names = self._keys(keys)
        deadline = self._begin()
        codes: list[int] = []
        for _ in range(1 + RPC_FAIL_RESENDS):  # again after a connection the master reset
            with client.call("batch_is_exist", self._count):
                codes = [int(code) for code in client.store.batch_is_exist(names)]
            if not codes or any(code != RPC_FAIL for code in codes):
                break
            if not deadline.allows(self._timeouts.cost("meta")):
                break
        client.check_batch(codes, "batch_is_exist", self._count)
        count = 0
        for code in codes:
            if code != 1:
                if code < 0:
                    self._count(code_name(code))
                break
            count += 1
        return count

    # -- zero-copy page I/O ---------------------------------------------------------------------

    def register_host_pool(self, pool: HostPool) -> None:
        """Attach ``pool`` and register its memory with the store once.

        A pool without a ``kv_buffer`` tensor cannot be registered; its pages then go through
        the copying path.

        Raises
        ------
        BackendIOError
            If Mooncake refuses to register the pool's memory.
        """
        self._release_region()
        kv_buffer = getattr(pool, "kv_buffer", None)
        if kv_buffer is not None and hasattr(kv_buffer, "data_ptr"):
            ptr = int(kv_buffer.data_ptr())
            self._client.retain(ptr, int(kv_buffer.numel() * kv_buffer.element_size()))
            self._region = ptr
        super().register_host_pool(pool)

    def _page_meta(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        meta = self.host_pool.page_buffer_meta(host_indices)
        if len(meta) != len(keys):
            raise IndexAlignmentError(
                f"{len(keys)} keys need {len(keys)} pages of host indices, got {len(meta)}"
            )
        ptrs = [[address for address, _ in page] for page in meta]
        sizes = [[nbytes for _, nbytes in page] for page in meta]
        return ptrs, sizes

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Read each key's object straight into its page's buffers in the registered pool."""
        deadline = self._begin()
        if self._region is None:
            return super().batch_get_v1(keys, host_indices)
        wide = self._wide_pages(keys, host_indices)
        if wide is not None:
            staged = super().batch_get_v1
            return self._split_wide(keys, host_indices, wide, self.batch_get_v1, staged)
        names, codes, sizes = self._move_pages(
            "batch_get_into_multi_buffers", "get", keys, host_indices, deadline
        )
        hits = self._hits(codes, [sum(page) for page in sizes], names, deadline)
        self._tally("pages_read", sum(hits))
        return hits

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's page straight from its buffers in the registered pool."""
        deadline = self._begin()
        if self._region is None:
            return super().batch_set_v1(keys, host_indices)
        wide = self._wide_pages(keys, host_indices)
        if wide is not None:
            staged = super().batch_set_v1
            return self._split_wide(keys, host_indices, wide, self.batch_set_v1, staged)
        _, codes, _ = self._move_pages(
            "batch_put_from_multi_buffers", "put", keys, host_indices, deadline
        )
        stored = self._stored(codes)
        self._tally("pages_written", sum(stored))
        return stored

    def _wide_pages(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool] | None:
        """Flag each page with more than :data:`MAX_CALL_BUFFERS` buffers; None when none has."""
        counts = [len(page) for page in self.host_pool.page_buffer_meta(host_indices)]
        if len(counts) != len(keys):
            raise IndexAlignmentError(
                f"{len(keys)} keys need {len(keys)} pages of host indices, got {len(counts)}"
            )
        wide = [count > MAX_CALL_BUFFERS for count in counts]
        return wide if any(wide) else None

    def _split_wide(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor | Sequence[int],
        wide: Sequence[bool],
        direct: Callable[[list[str], list[int]], list[bool]],
        staged: Callable[[list[str], list[int]], list[bool]],
    ) -> list[bool]:
        """Move the narrow pages with ``direct`` and the wide ones with ``staged``, in order.

        Each part is a call of its own, under its own ``deadline_s``: a batch that mixes both
        kinds may take up to twice the deadline.
        """
        page = self.host_pool.page_size
        indices = [int(i) for i in host_indices]
        results = [False] * len(keys)
        for flag, call in ((False, direct), (True, staged)):
            chosen = [i for i, is_wide in enumerate(wide) if is_wide == flag]
            if chosen:
                picked = [t for i in chosen for t in indices[i * page : (i + 1) * page]]
                for i, result in zip(chosen, call(_pick(keys, chosen), picked), strict=True):
                    results[i] = result
        return results

    def _move_pages(
        self,
        op: str,
        request: Request,
        keys: Sequence[str],
        host_indices: torch.Tensor | Sequence[int],
        deadline: Deadline,
    ) -> tuple[list[str], list[int], list[list[int]]]:
        """Run the multi-buffer call ``op`` on each key's page buffers, in place.

        Returns the store's names of the keys, one return code per key and the buffer sizes of
        each page. A name repeated in one batch goes in a later call (see :func:`unique_rounds`).
        """
        ptrs, sizes = self._page_meta(keys, host_indices)
        names = self._keys(keys)
        client = self._client
        call = getattr(client.store, op)

        def run(members: Sequence[int]) -> list[int]:
            with client.call(op, self._count):
                got = call(_pick(names, members), _pick(ptrs, members), _pick(sizes, members))
                return [int(code) for code in got]

        groups = buffer_groups(unique_rounds(names), [len(page) for page in sizes])
        codes = self._run_groups(groups, len(names), request, deadline, run)
        client.check_batch(codes, op, self._count)
        return names, codes, sizes

    # -- the staging path -----------------------------------------------------------------------

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
            for group in self._chunks(_pick(sizes, members))
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
            return self._run_groups(groups, len(names), request, deadline, run)
        finally:
            client.staging_lock.release()

    def _staged_put(
        self, names: list[str], views: list[memoryview], deadline: Deadline
    ) -> list[bool]:
        client = self._client
        present = [i for i, view in enumerate(views) if view.nbytes]
        if len(present) < len(views):
            self._count("empty_value", len(views) - len(present))

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
            with client.call("batch_put_from", self._count):
                got = client.store.batch_put_from(group_names, offsets, group_sizes)
                return [int(code) for code in got]

        chosen = [views[i] for i in present]
        codes = self._staged([names[i] for i in present], chosen, "put", deadline, put)
        client.check_batch(codes, "batch_put_from", self._count)
        stored = [False] * len(views)
        for index, ok in zip(present, self._stored(codes), strict=True):
            stored[index] = ok
        self._tally("bytes_staged", sum(view.nbytes for view in chosen))
        return stored

    def _staged_get(
        self, names: list[str], views: list[memoryview], deadline: Deadline
    ) -> list[bool]:
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
            with client.call("batch_get_into_multi_buffers", self._count):
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
        client.check_batch(codes, "batch_get_into_multi_buffers", self._count)
        hits = [False] * len(views)
        answers = self._hits(
            codes, [view.nbytes for view in chosen], _pick(names, present), deadline
        )
        for index, hit in zip(present, answers, strict=True):
            hits[index] = hit
        self._tally("bytes_staged", sum(v.nbytes for v, h in zip(views, hits, strict=True) if h))
        return hits

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key`` (forcing past Mooncake's read lease); return whether it existed.

        Raises
        ------
        BackendIOError
            If the store refused for another reason.
        """
        deadline = self._begin()
        name = self._keys([key])[0]
        code = self._meta(deadline, "remove", lambda: self._client.store.remove(name, True))
        if code == 0:
            return True
        if code in (NOT_FOUND, _NOT_READY):  # absent, or its put is still in flight: no value
            return False
        self._count(code_name(code))
        raise BackendIOError(f"mooncake remove of {key!r} failed with {code} ({code_name(code)})")

    def clear(self) -> None:
        """Remove every key of this backend's namespace (other namespaces' keys stay).

        The namespace is the names ``<prefix>/<key>`` (with no '/' in ``<key>``), or, with no
        prefix, the names without '/'.
        """
        deadline = self._begin()
        pattern = clear_pattern(self._prefix)
        code = self._meta(
            deadline, "remove_by_regex", lambda: self._client.store.remove_by_regex(pattern, True)
        )
        if code < 0:
            self._count(code_name(code))
            raise BackendIOError(f"mooncake remove_by_regex failed with {code} ({code_name(code)})")

    def stats(self) -> dict[str, Any]:
        """Return the base stats, the connection, moved pages/bytes and errors by reason."""
        stats = super().stats()
        with self._lock:
            errors = dict(self._errors)
            moved = dict(self._moved)
        stats.update(
            master=self.settings.master,
            protocol=self.settings.protocol,
            prefix=self._prefix,
            deadline_s=self._timeouts.deadline_s,
            rpc_timeout_s=self._timeouts.rpc_s,
            transfer_timeout_s=self._timeouts.transfer_s,
            master_down=self._client.down,
            zero_copy=self._region is not None,
            registered_bytes=self._client.registered_bytes(),
            pages_written=moved.get("pages_written", 0),
            pages_read=moved.get("pages_read", 0),
            bytes_staged=moved.get("bytes_staged", 0),
            errors=errors,
        )
        if self.config.master_metrics is not None:
            try:
                stats["capacity"] = self._capacity(self.config.master_metrics)
            except (OSError, ValueError, KeyError) as exc:  # KeyError: a metric it lacks
                stats["capacity_error"] = f"{self.config.master_metrics}: {exc!r}"
        return stats

    def _capacity(self, address: str) -> Capacity:
        """Read how full the store is from the master's metrics, within ``deadline_s``.

        The master's own figures, for every client of the store: memory allocated to objects
        against the segments' total, and the keys it evicted.
        """
        url = f"http://{address}/metrics"
        with urllib.request.urlopen(url, timeout=self._timeouts.deadline_s) as reply:
            text = reply.read().decode(errors="replace")
        values: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name and not name.startswith("#") and "{" not in name:
                values[name] = float(value)
        return Capacity(
            scope="server",
            used_bytes=int(values["master_allocated_bytes"]),
            bound_bytes=int(values["master_total_capacity_bytes"]),
            evictions=int(values.get("master_evicted_key_count", 0)),
        )

    def _release_region(self) -> None:
        if self._region is not None:
            self._client.release(self._region)
            self._region = None

    def _close(self) -> None:
        self._release_region()
