"""Backups to storage, and the host room they hold until written.

:class:`StorageWrites` queues host pages for the storage writer and applies what it reports
(:meth:`~StorageWrites.complete`): a written page is marked stored, its host copy unpinned. It
also makes room on the host (:meth:`~StorageWrites.alloc_host`), since that is where room and
writes meet: a host page storage does not hold is written before it is evicted, and room-making
may wait for writes to free it. A page whose path has no host room reaches storage through
staging slots the tree does not hold (:meth:`~StorageWrites.stage`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .copies import CopiesInFlight, StoredCopies
from .fetch_decisions import FetchDecisions
from .health import Bypass
from .leases import Lease
from .nodes import Node, Tier
from .storage_jobs import Backup, BackupDone
from .tiers import Tiers

__all__ = ["StorageWrites"]

_WRITE_WAIT_S = 0.05
"""How long room-making on the host waits for one background write at a time."""


class StorageWrites:
    """The writes queued for storage, and the host room they and fetches need.

    Parameters
    ----------
    tiers
        The cache's shared state.
    copies
        Copies in flight: staged pages are copied to the host first, and loads done with a
        host copy release it.
    stored_copies
        Host copies of stored pages, told when one is evicted unread.
    decisions
        The prefetch policy's: whether a write is worth a wait, whether the store is bypassed.
    """

    def __init__(
        self,
        tiers: Tiers,
        copies: CopiesInFlight,
        stored_copies: StoredCopies,
        decisions: FetchDecisions,
    ) -> None:
        self.tiers = tiers
        self.copies = copies
        self.stored_copies = stored_copies
        self.decisions = decisions
        self.writing: dict[int, tuple[Node, frozenset[str], torch.Tensor | None]] = {}
        """Nodes whose pages are being written: their hashes, and the staging slots the pages
        are written from when the node's host copy is not (:meth:`stage`)."""
        self._writing_pages = 0
        """Pages of :attr:`writing`, kept as it changes (the scheduler asks every step)."""
        host_size = 0 if tiers.host_pool is None else tiers.host_pool.size
        self._backlog_tokens = max(tiers.page_size, int(host_size * tiers.config.write.backlog))
        self._write_failed: set[int] = set()
        self._unstaged: list[Node] = []
        """Device nodes a write-through found no host room for, staged as room frees."""

    @property
    def backlog_tokens(self) -> int:
        """Host tokens pinned until the writes queued for them are done."""
        return self._writing_pages * self.tiers.page_size

    # -- host room --------------------------------------------------------------------------------

    def alloc_host(self, count: int, *, stored_only: bool = False) -> torch.Tensor | None:
        """Allocate host slots, evicting host leaves to storage (written first when unstored).

        With ``stored_only``, only leaves already in storage are evicted (nothing is written or
        waited for); None if that does not make room. Waiting for writes hurries the writer:
        measured on the H200, a fetch that waited for a later step instead lost more to
        recompute (its request priced the wait out) than the blocked steps cost. A store whose
        pages read back slower than they compute is not waited for
        (:meth:`FetchDecisions.writes_pay
        <hicache_storage.engine.fetch_decisions.FetchDecisions.writes_pay>`; under
        ``adaptive``, nor one that writes slower than its writer is offered pages): None.
        Backups the writer finished meanwhile (written or shed) are applied before either.
        """
        tiers = self.tiers
        pool = tiers.host_pool
        if pool is None:
            return None
        if pool.allocator.available_size() < count:
            self.copies.unpin_loaded()
        while pool.allocator.available_size() < count:
            victim = next(tiers.tree.evictable(Tier.HOST), None)
            if stored_only and (victim is None or not (victim.stored or tiers.io is None)):
                return None
            if victim is None:
                if not self.writing or tiers.io is None:
                    return None
                finished = tiers.io.poll()  # shed or written since the step began: no wait
                for done in finished:
                    self.complete(done)
                if finished:
                    continue
                if not self.decisions.writes_pay():
                    tiers.stats.write_waits_skipped += 1
                    return None
                began = time.monotonic()
                tiers.io.hurry()
                for done in tiers.io.poll(timeout_s=_WRITE_WAIT_S):
                    self.complete(done)
                tiers.stats.host_room_wait_s += time.monotonic() - began
                if not tiers.io.alive:
                    return None
                continue
            unstored = not victim.stored and tiers.io is not None
            storable = unstored and victim.id not in self._write_failed
            if storable and not self.shed_write() and self.store_later(victim):
                continue  # evicted once written (a failed write is not retried here)
            if unstored and victim.id not in self.writing:  # a staged write still stores it
                tiers.stats.pages_dropped += victim.num_tokens // tiers.page_size
            self._write_failed.discard(victim.id)
            self.stored_copies.outcome(victim, hit=False)
            pool.free(tiers.tree.evict_host(victim))
        return pool.alloc(count)

    # -- queueing writes --------------------------------------------------------------------------

    def mark_in_storage(self, lease: Lease, tokens: Sequence[int]) -> None:
        """Mark stored the nodes a request computed over pages its query found in storage.

        Writing them again would cost a host copy, host room (waited for while earlier writes
        drain) and a storage write, for pages storage has: measured on the H200, requests that
        recomputed pages whose fetch was cut fed a round of such waits and further cuts.
        """
        begin, end = lease.in_storage
        end = min(end, len(tokens))
        if self.tiers.io is None or end <= begin:
            return
        # Split the tree at both ends, so that whole nodes cover the stretch.
        self.tiers.tree.match_prefix(tokens[:begin], seed=lease.seed, touch=False)
        match = self.tiers.tree.match_prefix(tokens[:end], seed=lease.seed, touch=False)
        pos = 0
        for node in self.tiers.tree.path(match.last_node):
            if node.is_root:
                continue
            if pos >= begin and not node.stored:
                self.tiers.tree.mark_stored(node)
                self.tiers.stats.pages_known_stored += node.num_tokens // self.tiers.page_size
            pos += node.num_tokens

    def shed_write(self) -> bool:
        """Whether the store is bypassed, counting the write not made (``writes_shed``, why)."""
        reason = self.decisions.bypass()
        if reason is None:
            return False
        self.tiers.stats.writes_shed += 1
        self.tiers.stats.writes_shed_failing += reason is Bypass.FAILING
        return True

    def write_path(self, node: Node, *, backed_up: bool) -> None:
        """Queue the unstored pages of ``node``'s path for storage (write-through).

        ``backed_up`` says whether the path was put on the host; where it was not, its unstored
        device pages are written through staging slots instead (:meth:`stage`).
        """
        if self.tiers.io is None or self.shed_write():
            return
        path = self.tiers.tree.path(node)
        for i, step in enumerate(path):
            if step.stored:
                continue
            if Tier.HOST in step.tiers:
                self.store_later(step)
            elif not backed_up and not self.stage(step):
                self._unstaged.extend(n for n in path[i:] if not n.stored)  # when room frees
                return

    def stage(self, node: Node, *, evict: bool = True) -> bool:
        """Write a device node's pages to storage through host slots the tree does not hold.

        A node is on the host only under its parent (the tree's prefix rule), so when a long
        stored prefix finds no host room, the pages computed after it could reach storage no
        other way: their conversation would recompute them every round. The slots come from
        free room or stored host leaves (no wait) and go back once the write is done. Where
        that room is short of the node, its leading pages are staged (the node split where
        they end) and the rest waits for room (:meth:`retry_stages`): a document larger than
        the free host was otherwise never written. Without ``evict`` only free room is taken
        (a retry does not evict the host's cache for it). False when not a page finds room or
        the writer refuses the job.
        """
        if node.id in self.writing:
            return True
        tiers = self.tiers
        device = node.device_indices
        if device is None or tiers.transfer is None or not tiers.scheme.is_writer:
            return False
        assert tiers.io is not None and tiers.host_pool is not None
        pool = tiers.host_pool
        if evict:
            host = self.alloc_host(node.num_tokens, stored_only=True)
        else:
            host = pool.alloc(node.num_tokens) if tiers.free_host() >= node.num_tokens else None
        if host is None:  # the room stored leaves made is free now: stage what fits
            room = tiers.free_host() // tiers.page_size * tiers.page_size
            if room == 0:
                return False
            tokens = [t for step in tiers.tree.path(node) for t in step.tokens]
            start = len(tokens) - node.num_tokens
            head = tiers.tree.match_prefix(
                tokens[: start + room], seed=node.namespace, touch=False
            ).last_node  # the upper part of the split; ``node`` keeps the rest
            staged = self.stage(head, evict=False)
            if not staged:  # the writer refused it: both wait, the head first
                self._unstaged.append(head)
            self._unstaged.append(node)
            return staged
        fence = self.copies.copy_to_host(device, host)
        if not self._queue_write(node, host, fence.wait, staging=host):
            pool.free(host)
            return False
        tiers.stats.pages_staged += node.num_tokens // tiers.page_size
        return True

    def retry_stages(self) -> None:
        """Stage the pages a write-through left for lack of host room, oldest first.

        Called as writes finish (their staging slots free room), taking free room only;
        stops at the first node that finds none, so a path is written from its root down. A
        node no longer on the device (evicted meanwhile, counted in ``pages_dropped``) or
        stored is forgotten.
        """
        if not self._unstaged or self.decisions.bypassed():
            return
        pending, self._unstaged = self._unstaged, []
        still: list[Node] = []
        for node in pending:
            if not node.in_tree or node.stored or node.id in self.writing:
                continue
            if Tier.HOST in node.tiers:
                self.store_later(node)
            elif node.device_indices is not None and (still or not self.stage(node, evict=False)):
                still.append(node)
        self._unstaged = self._unstaged + still  # the tails of nodes staged in part go first

    def store_later(self, node: Node) -> bool:
        """Queue a host node's pages for storage, its host copy pinned until written.

        False for a node whose pages are being written through staging slots: its host copy
        is not needed for the write and may be evicted.
        """
        tiers = self.tiers
        host = node.host_indices
        if tiers.io is None or host is None or not tiers.scheme.is_writer:
            return False
        if node.id in self.writing:
            return self.writing[node.id][2] is None
        fence = self.copies.fence()
        ready = None if fence is None else fence.wait
        if not self._queue_write(node, host, ready, staging=None):
            return False
        tiers.tree.pin_host(node)
        return True

    def _queue_write(
        self,
        node: Node,
        host: torch.Tensor,
        ready: Callable[[], None] | None,
        *,
        staging: torch.Tensor | None,
    ) -> bool:
        """Queue ``node``'s pages at ``host`` for storage; False when the writer refuses them.

        ``staging`` is the slots to free once written (a staged write), None for the node's
        own host copy.
        """
        tiers = self.tiers
        assert tiers.io is not None
        scheme = tiers.scheme
        job = Backup(scheme.keys(node.hashes), host, node.id, ready, scheme.keys_per_page)
        if not tiers.io.backup(job):
            return False
        assert node.id not in self.writing  # both callers write a node once at a time
        hashes = frozenset(node.hashes)
        self.writing[node.id] = (node, hashes, staging)
        self._writing_pages += len(hashes)
        if self.backlog_tokens > self._backlog_tokens:
            tiers.io.hurry()  # the host fills with pages waiting for storage faster than it drains
        return True

    # -- what the writer reports ------------------------------------------------------------------

    def poll(self) -> None:
        """Apply the backups the writer finished, then stage what waited for their room."""
        assert self.tiers.io is not None
        for done in self.tiers.io.poll():
            self.complete(done)
        self.retry_stages()

    def complete(self, done: BackupDone) -> None:
        """Apply a finished backup: unpin or free its slots, mark stored what is still in the tree.

        A staged write (:meth:`stage`) frees its staging slots; the others unpin the node's
        host copy. A backup the planner shed is released as a failed one is (its node is not
        written again when evicted, see :meth:`alloc_host`), counted by the planner's rule in
        ``backup_pages_shed``.
        """
        tiers = self.tiers
        ticket = done.backup.ticket
        assert isinstance(ticket, int)
        node, hashes, staging = self.writing.pop(ticket)
        self._writing_pages -= len(hashes)
        if staging is None:
            tiers.tree.unpin_host(node)
        elif tiers.host_pool is not None:
            tiers.host_pool.free(staging)
        pages = len(hashes)
        if not done.stored:
            if done.shed:  # the store was failing: its writer dropped the backup untried
                tiers.stats.writes_shed += 1
                tiers.stats.writes_shed_failing += 1
            elif done.shed_by is not None:  # the planner's back-pressure: released unwritten
                shed = tiers.stats.backup_pages_shed
                shed[done.shed_by] = shed.get(done.shed_by, 0) + pages
            else:
                tiers.stats.backups_failed += pages
            self._write_failed.add(node.id)
            return
        self._write_failed.discard(node.id)
        tiers.stats.pages_stored += pages
        tiers.stats.storage_bytes_written += pages * tiers.page_size * tiers.token_bytes
        step: Node | None = node
        while step is not None and not step.is_root and step.in_tree:
            if not set(step.hashes) <= hashes:
                break
            tiers.tree.mark_stored(step)
            step = step.parent
