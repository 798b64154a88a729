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

import urllib.request
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.capabilities import Capabilities
from hicache_storage.capacity import Capacity
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendIOError,
    BufferSizeError,
    IndexAlignmentError,
    InvalidKeyError,
)
from hicache_storage.kit import Deadline, closed_guard

from .client import (
    NOT_FOUND,
    RPC_FAIL,
    Request,
    SharedClient,
    acquire,
    code_name,
)
from .config import MooncakeConfig, MooncakeSettings, capabilities
from .requests import RPC_FAIL_RESENDS, Requests, pick, unique_rounds

if TYPE_CHECKING:
    import torch

__all__ = ["MooncakeBackend", "capabilities_for", "clear_pattern", "unique_rounds"]

_NOT_READY = -703
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
        self._region: int | None = None
        self._client: SharedClient = acquire(self.settings)
        self._timeouts = self._client.timeouts
        self._requests = Requests(self._client)

    # -- bookkeeping ----------------------------------------------------------------------------

    @property
    def close_timeout_s(self) -> float:
        """How long ``close()`` waits for calls in flight (and their transfers): ``deadline_s``."""
        return self._timeouts.deadline_s

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
        deadline = self._requests.begin()
        name = self._keys([key])[0]
        size = self._requests.meta(deadline, "get_size", lambda: self._client.store.get_size(name))
        if size < 0:
            if size not in (NOT_FOUND, _NOT_READY):
                self._requests.count(code_name(size))
            return None
        value = bytearray(size) if out is None else None
        view = memoryview(value) if value is not None else as_writable(out)
        if view.nbytes != size:
            raise BufferSizeError(
                f"output buffer has {view.nbytes} bytes but the object stored under {key!r} "
                f"has {size}"
            )
        if not self._requests.staged_get([name], [view], deadline)[0]:
            return None
        return value if value is not None else out

    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds a complete value."""
        deadline = self._requests.begin()
        name = self._keys([key])[0]
        code = self._requests.meta(deadline, "is_exist", lambda: self._client.store.is_exist(name))
        if code < 0:
            self._requests.count(code_name(code))
        return code == 1

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds one already (the first value wins).

        Returns False when the store refuses the value (empty, no space): the reason is
        counted in ``stats()``.
        """
        deadline = self._requests.begin()
        return self._requests.staged_put(self._keys([key]), [as_readable(value)], deadline)[0]

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its output buffer; an object of another size is a miss."""
        deadline = self._requests.begin()
        views = [as_writable(out) for out in outs]
        return self._requests.staged_get(self._keys(keys), views, deadline)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key; return per key whether it now holds a value."""
        deadline = self._requests.begin()
        views = [as_readable(value) for value in values]
        return self._requests.staged_put(self._keys(keys), views, deadline)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist (one ``batch_is_exist``)."""
        # One request, the first: always within the deadline.
        if not keys:
            return 0
        client = self._client
        names = self._keys(keys)
        deadline = self._requests.begin()
        codes: list[int] = []
        for _ in range(1 + RPC_FAIL_RESENDS):  # again after a connection the master reset
            with client.call("batch_is_exist", self._requests.count):
                codes = [int(code) for code in client.store.batch_is_exist(names)]
            if not codes or any(code != RPC_FAIL for code in codes):
                break
            if not deadline.allows(self._timeouts.cost("meta")):
                break
        client.check_batch(codes, "batch_is_exist", self._requests.count)
        count = 0
        for code in codes:
            if code != 1:
                if code < 0:
                    self._requests.count(code_name(code))
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
        deadline = self._requests.begin()
        if self._region is None:
            return super().batch_get_v1(keys, host_indices)
        wide = self._wide_pages(keys, host_indices)
        if wide is not None:
            staged = super().batch_get_v1
            return self._split_wide(keys, host_indices, wide, self.batch_get_v1, staged)
        names, codes, sizes = self._move_pages(
            "batch_get_into_multi_buffers", "get", keys, host_indices, deadline
        )
        hits = self._requests.hits(codes, [sum(page) for page in sizes], names, deadline)
        self._requests.tally("pages_read", sum(hits))
        return hits

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's page straight from its buffers in the registered pool."""
        deadline = self._requests.begin()
        if self._region is None:
            return super().batch_set_v1(keys, host_indices)
        wide = self._wide_pages(keys, host_indices)
        if wide is not None:
            staged = super().batch_set_v1
            return self._split_wide(keys, host_indices, wide, self.batch_set_v1, staged)
        _, codes, _ = self._move_pages(
            "batch_put_from_multi_buffers", "put", keys, host_indices, deadline
        )
        stored = self._requests.stored(codes)
        self._requests.tally("pages_written", sum(stored))
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
                for i, result in zip(chosen, call(pick(keys, chosen), picked), strict=True):
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
            with client.call(op, self._requests.count):
                got = call(pick(names, members), pick(ptrs, members), pick(sizes, members))
                return [int(code) for code in got]

        groups = buffer_groups(unique_rounds(names), [len(page) for page in sizes])
        codes = self._requests.run_groups(groups, len(names), request, deadline, run)
        client.check_batch(codes, op, self._requests.count)
        return names, codes, sizes

    # -- housekeeping ---------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key`` (forcing past Mooncake's read lease); return whether it existed.

        Raises
        ------
        BackendIOError
            If the store refused for another reason.
        """
        deadline = self._requests.begin()
        name = self._keys([key])[0]
        code = self._requests.meta(
            deadline, "remove", lambda: self._client.store.remove(name, True)
        )
        if code == 0:
            return True
        if code in (NOT_FOUND, _NOT_READY):  # absent, or its put is still in flight: no value
            return False
        self._requests.count(code_name(code))
        raise BackendIOError(f"mooncake remove of {key!r} failed with {code} ({code_name(code)})")

    def clear(self) -> None:
        """Remove every key of this backend's namespace (other namespaces' keys stay).

        The namespace is the names ``<prefix>/<key>`` (with no '/' in ``<key>``), or, with no
        prefix, the names without '/'.
        """
        deadline = self._requests.begin()
        pattern = clear_pattern(self._prefix)
        code = self._requests.meta(
            deadline, "remove_by_regex", lambda: self._client.store.remove_by_regex(pattern, True)
        )
        if code < 0:
            self._requests.count(code_name(code))
            raise BackendIOError(f"mooncake remove_by_regex failed with {code} ({code_name(code)})")

    def stats(self) -> dict[str, Any]:
        """Return the base stats, the connection, moved pages/bytes and errors by reason."""
        stats = super().stats()
        errors, moved = self._requests.counts()
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
