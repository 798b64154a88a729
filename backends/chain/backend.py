"""The ``chain`` backend: tiers of backends, fastest first, served as one.

A local disk in front of a remote store (LMCache's and Dynamo's cascade) as one backend, so an
engine that takes one storage backend (SGLang's ``dynamic`` entry, vLLM's tier) gets both:

* ``batch_exists`` answers the longest leading run of keys held across the tiers together; a
  read asks the first tier first unless asking the later ones first is measured cheaper
  (:class:`~.read_order.ReadOrder`), each tier for what those asked before it missed; a page a
  later tier served is
  promoted into the earlier tiers when :class:`~.promotion.HitCountPromotion` admits it: the
  read copies the admitted pages (from the caller's buffers or host-pool pages) and returns,
  and a thread of the chain stores them (:mod:`.promoter`);
* pages (written or promoted) go into the first tier only while that is measured to pay for
  its writes (:class:`~.promotion.FirstTierPays`);
* a write stores every tier at once (``write_policy="through"``) or the first tier, the later
  ones from a queue (``"behind"``, :mod:`.behind`);
* each tier is built with layers of its own (degrade-to-miss and health by default), so a tier
  that fails or stops answering is a counted miss at once: a remote outage costs no local hit,
  and a local disk that cannot store a page leaves the remote tiers to hold it.

The pages are verified by the layers around the whole chain, against records stored through
the chain like any page, so a promoted page is checked whenever the chain serves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from typing_extensions import Buffer

from hicache_storage.backend import HostPool, StorageBackend
from hicache_storage.buffers import as_readable
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import Deployment
from hicache_storage.errors import UnsupportedOperationError
from hicache_storage.factory import create_backend
from hicache_storage.kit import closed_guard
from hicache_storage.kit.parallel import Beside

from .behind import WriteBehind
from .config import ChainConfig
from .promoter import Promoter
from .promotion import FirstTierPays, HitCountPromotion
from .read_order import ReadOrder
from .turns import KeyTurns

if TYPE_CHECKING:
    import torch

__all__ = ["ChainBackend", "ChainConfig", "chain_capabilities"]

TURNS: Final = KeyTurns()
"""The keys being written through any chain of this process (see :mod:`.turns`)."""

_READ_KINDS: Final = ("first_read", "later_read")
"""The rate a tier's read call feeds (:meth:`FirstTierPays.observe`), by ``index > 0``."""

PROMOTION_BACKOFF_S: Final = (1.0, 60.0)
"""After a tier fails to store a promoted page (full, read-only, unreachable), promotions into it
are shed for the first value, doubling on each failure up to the second: a tier that cannot
absorb pages is asked again about once a second, not on every read. A page larger than the
tier's bound is no failure of the tier (it answered; the page cannot fit): it is refused, and
the other pages are still offered."""


def chain_capabilities(tiers: Sequence[Capabilities]) -> Capabilities:
    """Return what a chain of backends with these claims promises, fastest tier first.

    A promise every page keeps must hold in every tier that may serve it (sharing, deletion,
    crash safety, zero copy, bounds, expiry); durability needs one tier that keeps every page
    (writes reach every tier). First-wins is claimed only by one tier alone: two writers of a key
    may each win a different tier, and a reader could see one value and later the other.
    """
    sizes = [c.max_value_size for c in tiers if c.max_value_size is not None]
    return Capabilities(
        persistent=any(c.persistent for c in tiers),
        shared=all(c.shared for c in tiers),
        native_zero_copy=all(c.native_zero_copy for c in tiers),
        bounded=all(c.bounded for c in tiers),
        delete=all(c.delete for c in tiers),
        ttl=all(c.ttl for c in tiers),
        crash_safe_writes=all(c.crash_safe_writes for c in tiers),
        atomic_first_wins=len(tiers) == 1 and tiers[0].atomic_first_wins,
        max_value_size=min(sizes) if sizes else None,
        exists_stale_s=max(c.exists_stale_s for c in tiers),
        foreign_names=any(c.foreign_names for c in tiers),
        shared_host_pool=any(c.shared_host_pool for c in tiers),
    )


Family = str
"""One of :data:`FAMILIES` (a plain string: the promoter hands it back with the pages)."""

FAMILIES: Final[tuple[Family, ...]] = ("pages", "objects")
"""What the chain measures apart: host-pool pages (``batch_get_v1``, ``batch_set_v1``) and objects
(the copying calls, e.g. the integrity record stored beside each page, thousands of times
smaller). A rate per key mixing the two is whichever family called last; each family has its
read order and first-tier rule of its own."""


@dataclasses.dataclass
class _Measures:
    """A family's measured rules: which tiers a read asks first, what the first tier gets."""

    pays: FirstTierPays = dataclasses.field(default_factory=FirstTierPays)
    order: ReadOrder = dataclasses.field(default_factory=ReadOrder)
    held: int = 0
    """Keys a write found held by a tier already: their first value kept, not written again."""
    filled: int = 0
    """Of those, copies of the first tier's value given to later tiers that lacked the key."""


@dataclasses.dataclass
class _Tier:
    """A built tier and what the chain counted of it."""

    name: str
    backend: StorageBackend
    hits: int = 0
    promoted: int = 0
    promotion_failed: int = 0
    promotion_shed: int = 0
    promotion_refused: int = 0
    backoff_s: float = 0.0
    promote_from: float = 0.0
    bound: int | None = None
    """The tier's capacity bound, once a failed promotion asked it (``ChainBackend._bound_of``)."""


@closed_guard
class ChainBackend(StorageBackend):
    """Serve ``config.tiers`` as one backend: reads from the fastest holder, writes to all."""

    name = "chain"

    def __init__(self, config: ChainConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self._config = config
        self._tiers: list[_Tier] = []
        try:
            for index, tier in enumerate(config.tiers):
                built = create_backend(
                    tier.backend,
                    tier.options,
                    deployment=deployment,
                    layers=tier.layers,
                    strict_start=False,
                    tier=str(index),
                )
                self._tiers.append(_Tier(built.name, built))
        except BaseException:
            self._close_tiers()
            raise
        self.capabilities = chain_capabilities([t.backend.capabilities for t in self._tiers])
        self._promotion = HitCountPromotion(config.promote_after_hits)
        self._measures = {family: _Measures() for family in FAMILIES}
        self._lock = threading.Lock()
        self._promoter = Promoter(self._promote_copies)
        self._behind = (
            WriteBehind(
                self._tiers[0].backend,
                [t.backend for t in self._tiers[1:]],
                config.max_pending_pages,
            )
            if config.write_policy == "behind" and len(self._tiers) > 1
            else None
        )

    @property
    def tiers(self) -> list[StorageBackend]:
        """The tiers' backends (each in its own layers), fastest first."""
        return [t.backend for t in self._tiers]

    # -- reads ------------------------------------------------------------------------------------

    def _read_order(self, family: Family) -> list[int]:
        """Return the tiers' indices in the order a read asks them (:mod:`.read_order`)."""
        order = list(range(len(self._tiers)))
        near = len(order) == 1 or self._measures[family].order.near_first()
        return order if near else [*order[1:], 0]

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value from the tier holding ``key`` asked first; promote it if admitted."""
        measures = self._measures["objects"]
        for turn, index in enumerate(self._read_order("objects")):
            tier = self._tiers[index]
            began = time.monotonic()
            value = tier.backend.get(key, out)
            seconds = time.monotonic() - began
            measures.pays.observe(_READ_KINDS[index > 0], value is not None, seconds)
            found = int(value is not None)
            measures.order.observe(
                near=index == 0, asked=1, found=found, seconds=seconds, first=turn == 0
            )
            if value is not None:
                self._count_hits(index, 1)
                measures.pays.served([key] if index == 0 else [], [key] if index else [])
                if index > 0 and self._admit([key], "objects")[0]:
                    self._queue_promotion(index, "objects", [key], [bytes(as_readable(value))])
                return value
        return None

    def _admit(self, keys: Sequence[str], family: Family) -> list[bool]:
        """Which later-tier hits to promote: read often enough, and while promotions pay."""
        counted = self._promotion.admit(keys)
        admitted = [k for k, ok in zip(keys, counted, strict=True) if ok]
        chosen = iter(self._measures[family].pays.choose(admitted))
        return [ok and next(chosen) for ok in counted]

    def exists(self, key: str) -> bool:
        """Return whether any tier holds ``key`` (the fastest asked first)."""
        return any(tier.backend.exists(key) for tier in self._tiers)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the leading run of ``keys`` held by the tiers together.

        Each tier extends the run where the earlier ones stopped; passes repeat while one adds
        to it, since a page after a later tier's run may be held by an earlier tier again. A
        tier is not asked again where its last answer ended: it said it lacks that key.
        """
        held = 0
        ended = [-1] * len(self._tiers)
        grown = True
        while grown and held < len(keys):
            grown = False
            for index, tier in enumerate(self._tiers):
                if held == len(keys):
                    break
                if ended[index] == held:
                    continue
                more = tier.backend.batch_exists(keys[held:])
                held += more
                ended[index] = held
                grown = grown or more > 0
        return held

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key from the first tier holding it; promote what later tiers served."""
        if len(keys) != len(outs):
            return super().batch_get(keys, outs)  # the base class names the mismatch
        return self._read(
            "objects",
            lambda t, picked: t.batch_get([keys[i] for i in picked], [outs[i] for i in picked]),
            keys,
            lambda served_by, chosen: self._queue_promotion(
                served_by,
                "objects",
                [keys[i] for i in chosen],
                [bytes(as_readable(outs[i])) for i in chosen],
            ),
        )

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Load each page from the tiers in read order; promote copies of the pages just loaded.

        The admitted pages are copied out of the host pool before the call returns (they are the
        caller's after it) and stored by the promoter's thread, as a copying read's are: a
        promotion stored inside the call made the request wait for a write into the first tier,
        which on a disk busy with the engine's writes can take a second.
        """
        pages = self.page_views(keys, host_indices)  # checks the pool and the indices up front
        size = self.host_pool.page_size

        def read(tier: StorageBackend, picked: list[int]) -> list[bool]:
            return tier.batch_get_v1(
                [keys[i] for i in picked], _pages_of(host_indices, picked, size)
            )

        def promote(served_by: int, chosen: list[int]) -> None:
            copies = [b"".join(pages[i]) for i in chosen]
            self._queue_promotion(served_by, "pages", [keys[i] for i in chosen], copies)

        return self._read("pages", read, keys, promote)

    def _read(
        self,
        family: Family,
        read: Callable[[StorageBackend, list[int]], list[bool]],
        keys: Sequence[str],
        promote: Callable[[int, list[int]], None],
    ) -> list[bool]:
        """Read ``keys``' positions tier by tier; promote the admitted later-tier hits.

        ``promote(served_by, positions)`` promotes the pages at ``positions`` that tier
        ``served_by`` served.
        """
        measures = self._measures[family]
        count = len(keys)
        hits = [False] * count
        served = [0] * count
        left = list(range(count))
        for turn, index in enumerate(self._read_order(family)):
            tier = self._tiers[index]
            if not left:
                break
            began = time.monotonic()
            found = read(tier.backend, left)
            seconds = time.monotonic() - began
            measures.pays.observe(_READ_KINDS[index > 0], sum(found), seconds)
            measures.order.observe(
                near=index == 0, asked=len(left), found=sum(found), seconds=seconds, first=turn == 0
            )
            missed = []
            for position, hit in zip(left, found, strict=True):
                if hit:
                    hits[position] = True
                    served[position] = index
                else:
                    missed.append(position)
            self._count_hits(index, len(left) - len(missed))
            left = missed
        later = [i for i in range(count) if hits[i] and served[i] > 0]
        measures.pays.served(
            [keys[i] for i in range(count) if hits[i] and served[i] == 0],
            [keys[i] for i in later],
        )
        if later:
            admitted = self._admit([keys[i] for i in later], family)
            for index in range(1, len(self._tiers)):
                chosen = [
                    i for i, ok in zip(later, admitted, strict=True) if ok and served[i] == index
                ]
                if chosen:
                    promote(index, chosen)
        return hits

    def _queue_promotion(
        self, served_by: int, family: Family, keys: list[str], copies: list[bytes]
    ) -> None:
        """Queue copies of pages tier ``served_by`` served; count those without room as shed."""
        shed = self._promoter.offer((served_by, family), keys, copies)
        if shed:
            with self._lock:
                for tier in self._tiers[:served_by]:
                    tier.promotion_shed += shed

    def _promote_copies(
        self, origin: tuple[int, Family], keys: list[str], copies: list[bytes]
    ) -> None:
        """Store queued copies into each earlier tier that can (the promoter's thread).

        ``origin`` is the tier that served them and their family. A page larger than the tier's
        bound is refused, not offered again; only a failure to store a page that fits backs the
        tier off (:data:`PROMOTION_BACKOFF_S`).
        """
        served_by, family = origin
        sizes = [len(c) for c in copies]
        now = time.monotonic()
        for index, tier in enumerate(self._tiers[:served_by]):
            with self._lock:
                if now < tier.promote_from:
                    tier.promotion_shed += len(sizes)
                    continue
                bound = tier.bound
            picked = [i for i, size in enumerate(sizes) if bound is None or size <= bound]
            began = time.monotonic()
            stored = (
                tier.backend.batch_set([keys[i] for i in picked], [copies[i] for i in picked])
                if picked
                else []
            )
            if index == 0 and picked:
                seconds = time.monotonic() - began
                self._measures[family].pays.observe("first_write", len(picked), seconds)
            failed = [i for i, ok in zip(picked, stored, strict=True) if not ok]
            if failed and bound is None:
                bound = self._bound_of(tier)
            too_big = sum(1 for i in failed if bound is not None and sizes[i] > bound)
            with self._lock:
                tier.promoted += len(picked) - len(failed)
                tier.promotion_failed += len(failed) - too_big
                tier.promotion_refused += len(sizes) - len(picked) + too_big
                if len(failed) > too_big:
                    low, high = PROMOTION_BACKOFF_S
                    tier.backoff_s = min(high, tier.backoff_s * 2 if tier.backoff_s else low)
                    tier.promote_from = time.monotonic() + tier.backoff_s
                elif len(picked) > too_big:
                    tier.backoff_s = 0.0

    def _bound_of(self, tier: _Tier) -> int | None:
        """Return (and keep) the tier's capacity bound; None where it has none or cannot say.

        Asked after a failed promotion only (a tier's ``stats`` may cost a round trip); a bound
        once known is kept, a tier's bound being its configuration.
        """
        try:
            capacity = tier.backend.stats().get("capacity") or {}
        except Exception:  # noqa: BLE001 - a tier that cannot say has no bound the chain knows
            return None
        bound = capacity.get("bound_bytes")
        if not isinstance(bound, int) or isinstance(bound, bool):
            return None
        with self._lock:
            tier.bound = bound
        return bound

    def _count_hits(self, index: int, count: int) -> None:
        if count:
            with self._lock:
                self._tiers[index].hits += count

    # -- writes -----------------------------------------------------------------------------------

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` in the tiers as the write policy says; True if any tier holds it."""
        return self.batch_set([key], [value])[0]

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value as the write policy says; per key, whether some tier holds it."""
        if len(keys) != len(values):
            return super().batch_set(keys, values)  # the base class names the mismatch
        sizes = [len(as_readable(value)) for value in values]
        return self._write(
            "objects",
            lambda t, picked: t.batch_set([keys[i] for i in picked], [values[i] for i in picked]),
            keys,
            sizes,
        )

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's page of the host pool as the write policy says."""
        self.page_views(keys, host_indices)
        pool = self.host_pool
        return self._write(
            "pages",
            lambda t, picked: t.batch_set_v1(
                [keys[i] for i in picked], _pages_of(host_indices, picked, pool.page_size)
            ),
            keys,
            [pool.page_nbytes] * len(keys),
        )

    def _write(
        self,
        family: Family,
        write: Callable[[StorageBackend, list[int]], list[bool]],
        keys: Sequence[str],
        sizes: list[int],
    ) -> list[bool]:
        """Write ``keys``' positions by the write policy, in their turns; whether stored."""
        return TURNS.write(
            keys, lambda picked: self._write_turn(family, picked, write, keys, sizes)
        )

    def _write_turn(
        self,
        family: Family,
        picked: list[int],
        write: Callable[[StorageBackend, list[int]], list[bool]],
        keys: Sequence[str],
        sizes: list[int],
    ) -> list[bool]:
        """Write ``picked`` (their turn taken) so that every tier keeps one value per key.

        Each tier keeps the first value written under a key, so the tiers agree only while
        each value a tier takes is the key's first. A key the first tier holds already is not
        written again: the later tiers that lack it (failing at its first write, or evicting
        since) get the first tier's value (:meth:`_fill_later`). A key chosen for the first
        tier that a later tier holds is not placed there (its first write withheld it; a
        promotion copies the value the later tier keeps). The rest go where the write policy
        sends them.
        """
        if len(self._tiers) == 1:
            return self._store(family, write, keys, sizes, picked, picked)
        first = self._tiers[0].backend
        again = [i for i in picked if first.exists(keys[i])]
        filled = self._fill_later([keys[i] for i in again], [sizes[i] for i in again])
        held = set(again)
        fresh = [i for i in picked if i not in held]
        near = self._near(family, fresh, keys)
        later = [t.backend for t in self._tiers[1:]]
        placed = [i for i in near if not any(tier.exists(keys[i]) for tier in later)]
        held.update(set(near) - set(placed))
        rest = [i for i in fresh if i not in held]
        with self._lock:
            self._measures[family].held += len(held)
            self._measures[family].filled += filled
        stored = dict.fromkeys(held, True)
        if rest:
            written = self._store(family, write, keys, sizes, rest, placed)
            stored.update(zip(rest, written, strict=True))
        return [stored[i] for i in picked]

    def _fill_later(self, keys: list[str], sizes: list[int]) -> int:
        """Copy ``keys``, which the first tier holds, into the later tiers that lack them.

        Behind the write (``"behind"``: its queue reads them back from the first tier), or now
        (``"through"``): a later tier is asked which it lacks and given the first tier's values.
        Returns the copies stored now.
        """
        if not keys:
            return 0
        if self._behind is not None:
            self._behind.offer(keys, sizes)
            return 0
        source = self._tiers[0].backend
        copied = 0
        for tier in self._tiers[1:]:
            lacking = [j for j, key in enumerate(keys) if not tier.backend.exists(key)]
            if not lacking:
                continue
            buffers = [bytearray(sizes[j]) for j in lacking]
            found = source.batch_get([keys[j] for j in lacking], buffers)
            read = [j for j, ok in enumerate(found) if ok]
            if read:
                done = tier.backend.batch_set(
                    [keys[lacking[j]] for j in read], [buffers[j] for j in read]
                )
                copied += sum(done)
        return copied

    def _store(
        self,
        family: Family,
        write: Callable[[StorageBackend, list[int]], list[bool]],
        keys: Sequence[str],
        sizes: list[int],
        rest: list[int],
        near: list[int],
    ) -> list[bool]:
        """Store ``rest`` by the write policy, ``near`` of them in the first tier too."""
        if self._behind is None:
            return self._write_through(family, rest, write, near)
        first = dict(zip(near, self._write_first(family, write, near), strict=True))
        kept = [i for i in rest if first.get(i, False)]
        if kept:
            self._behind.offer([keys[i] for i in kept], [sizes[i] for i in kept])
        stored = {i: first.get(i, False) for i in rest}
        lost = [i for i in rest if not stored[i]]  # the later tiers take them now
        if lost:
            stored.update(zip(lost, self._write_through(family, lost, write, []), strict=True))
        return [stored[i] for i in rest]

    def _write_through(
        self,
        family: Family,
        picked: list[int],
        write: Callable[[StorageBackend, list[int]], list[bool]],
        near: list[int],
    ) -> list[bool]:
        """Store ``picked`` in every later tier and ``near`` in the first at once; any has it."""
        later = [
            Beside(write, t.backend, picked, name="hicache-chain-tier") for t in self._tiers[1:]
        ]
        first = dict(zip(near, self._write_first(family, write, near), strict=True))
        results = [[first.get(position, False) for position in picked]]
        results += [run.result() for run in later]
        return [any(column) for column in zip(*results, strict=True)]

    def _near(self, family: Family, picked: list[int], keys: Sequence[str]) -> list[int]:
        """Return the positions of ``picked`` to write into the first tier (all, with one tier)."""
        if len(self._tiers) == 1 or not picked:
            return picked
        chosen = self._measures[family].pays.choose([keys[i] for i in picked])
        return [i for i, ok in zip(picked, chosen, strict=True) if ok]

    def _write_first(
        self,
        family: Family,
        write: Callable[[StorageBackend, list[int]], list[bool]],
        near: list[int],
    ) -> list[bool]:
        """Write ``near`` into the first tier, timing it for :class:`FirstTierPays`."""
        if not near:
            return []
        began = time.monotonic()
        stored = write(self._tiers[0].backend, near)
        seconds = time.monotonic() - began
        self._measures[family].pays.observe("first_write", len(near), seconds)
        return stored

    # -- housekeeping -----------------------------------------------------------------------------

    def register_host_pool(self, pool: HostPool) -> None:
        """Register ``pool`` with the chain and every tier."""
        super().register_host_pool(pool)
        for tier in self._tiers:
            tier.backend.register_host_pool(pool)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; return whether any held it."""
        if not self.capabilities.delete:
            raise UnsupportedOperationError("a tier of this chain cannot delete")
        with self._promoter.paused([key]), self._quiet_behind([key]):
            found = [tier.backend.delete(key) for tier in self._tiers]
        return any(found)

    def clear(self) -> None:
        """Clear every tier (pages still queued for later tiers are dropped first)."""
        with self._promoter.paused(None), self._quiet_behind(None):
            for tier in self._tiers:
                tier.backend.clear()

    def _quiet_behind(self, keys: list[str] | None) -> Any:
        """Hold write-behind still (and unqueue ``keys``, or all) while pages are removed."""
        if self._behind is None:
            return contextlib.nullcontext()
        return self._behind.paused(keys)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued promotions and write-behind pages were stored; return whether."""
        wait = self._config.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        if not self._promoter.flush(wait):
            return False
        return self._behind is None or self._behind.flush(max(deadline - time.monotonic(), 0.0))

    def stats(self) -> dict[str, Any]:
        """Per tier: hits, promotions into it, its own stats; promotions' fates; write-behind."""
        with self._lock:
            tiers = [
                {
                    "backend": tier.name,
                    "hits": tier.hits,
                    "promoted": tier.promoted,
                    "promotion_failed": tier.promotion_failed,
                    "promotion_shed": tier.promotion_shed,
                    "promotion_refused": tier.promotion_refused,
                }
                for tier in self._tiers
            ]
        for entry, tier in zip(tiers, self._tiers, strict=True):
            entry["stats"] = tier.backend.stats()
        out: dict[str, Any] = {
            "backend": self.name,
            "write_policy": self._config.write_policy,
            "tiers": tiers,
        }
        out["first_tier"] = {f: m.pays.stats() for f, m in self._measures.items()}
        out["read_order"] = {f: m.order.stats() for f, m in self._measures.items()}
        with self._lock:
            out["writes"] = {
                f: {"held": m.held, "filled": m.filled} for f, m in self._measures.items()
            }
        out["promotions"] = self._promoter.stats()
        if self._behind is not None:
            out["write_behind"] = self._behind.stats()
        return out

    def _close(self) -> None:
        self._promoter.close()
        if self._behind is not None:
            self._behind.close(self._config.drain_timeout_s)
        self._close_tiers()

    def _close_tiers(self) -> None:
        for tier in self._tiers:
            tier.backend.close()


def _pages_of(host_indices: torch.Tensor | Sequence[int], picked: list[int], page_size: int) -> Any:
    """Return the host indices of pages ``picked`` (``page_size`` entries each), same type."""
    if isinstance(host_indices, (list, tuple)):
        return [
            index for i in picked for index in host_indices[i * page_size : (i + 1) * page_size]
        ]
    return host_indices.reshape(-1, page_size)[picked].reshape(-1)  # type: ignore[union-attr]
