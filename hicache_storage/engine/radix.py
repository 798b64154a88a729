"""A radix tree of page-aligned token blocks whose nodes know in which tier their KV lives.

This is the index of the tier engine and a pure data structure: no I/O, no threads, no device
work. Index tensors are 1-D CPU ``int64`` tensors; the tree keeps its own copies and never frees
a slot itself: every call that drops indices returns them so that the caller frees them.

Each node holds a block of whole pages of tokens. A node's KV may live on the device (L1: one
device-pool token slot per token), on the host (L2: one host-pool slot per token) and in storage
(L3: every page was written under the node's page hashes). Page hashes chain as in
:func:`~hicache_storage.keys.page_hashes`: a node's chain continues from its parent's last hash,
and every namespace (a seed such as :func:`~hicache_storage.keys.namespace_seed` of the request's
``extra_key`` and ``cache_salt``) has a root of its own, so requests of different namespaces
never share a node. A namespace root holds no tokens and no KV; it exists while it has children,
and roots are told apart by their seed alone.

Tier transitions are methods of :class:`RadixTree`, the one owner of every page's tier state;
:class:`Node` is read-only from outside (it, :class:`Tier` and what the tree's calls return are
defined in :mod:`hicache_storage.engine.nodes` and importable from here). The rules below hold
after every call (``check()`` verifies them) and a call that would break one raises
:class:`RadixTreeError` and changes nothing:

1. Shape: a node holds a positive whole number of pages; its parent maps the tokens of its first
   page to it; its hashes are ``page_hashes(tokens, page_size, parent's last hash)``.
2. Indices: a node's device and host indices, where present, have one entry per token.
3. Residency: every node is on the device or on the host (or both). A node that would be on
   neither is removed from the tree, even when storage holds it: the tree tracks L1 and L2, and
   L3 answers for itself (``batch_exists`` on the hashes of :attr:`MatchResult.remainder_hashes`).
   ``stored`` only records that a copy was written, so that it is not written again.
4. Prefix closure: a node on the device has its parent on the device, and a node on the host has
   its parent on the host (a root counts as both). So a matched path is a device stretch
   followed by a host-only stretch, a load L2→L1 or a backup L1→L2 runs top-down, and a node
   left on no tier by an eviction is always a leaf.
5. Locks: ``lock(node)`` pins the node and its ancestors on every tier they are on;
   ``lock_ref`` counts the locks taken on a node and on its descendants. A locked node is never
   removed. ``lock(node, host=False)`` keeps the device copy alone: a node so locked that is on
   the device and stored may lose its host copy, a third copy of KV its holder (a running
   request) reads from the device. ``pin_host(node)`` pins only the node's host copy (a
   background write, a load or a prefetch anchored on it reads those slots); its device copy
   stays evictable, and its ancestors stay on the host by rule 4.
6. Eviction of a tier takes only the leaves of that tier's subtree: nodes on the tier with no
   child on it and no lock that keeps them there (for the host: no pin, and no lock unless every
   lock is ``host=False`` and the node is on the device and stored); :meth:`RadixTree.evictable`
   yields them least recently used first.

Splitting a node at a page boundary keeps the node object as the lower half and gives a new node
the upper half, with the matching slices of every tier's indices and hashes, the same ``stored``
flag, lock count, hit count and access time. So a node always names the same end position of a
prefix, and a lock taken before a split is released by the same ``unlock`` after it.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from hicache_storage.keys import page_hashes

from .nodes import InsertResult, MatchResult, Node, RadixTreeError, Tier

__all__ = ["InsertResult", "MatchResult", "Node", "RadixTree", "RadixTreeError", "Tier"]

_Page = tuple[int, ...]
_TOKEN_LIMIT = 2**63


class RadixTree:
    """Radix tree over whole pages of tokens, tracking device, host and storage residency.

    Parameters
    ----------
    page_size
        Tokens per page, at least 1; only whole pages are matched and inserted.
    clock
        Monotonic clock for access times (injectable for tests).
    """

    def __init__(self, page_size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if page_size < 1:
            raise RadixTreeError(f"page_size must be at least 1, got {page_size}")
        self._page_size = page_size
        self._clock = clock
        self._ids = itertools.count()
        self._roots: dict[str | None, Node] = {}
        self._tokens = {tier: 0 for tier in Tier}
        self._locked_tokens = 0
        self._candidates: dict[Tier, set[Node]] = {Tier.DEVICE: set(), Tier.HOST: set()}

    @property
    def page_size(self) -> int:
        """Return the number of tokens per page."""
        return self._page_size

    @property
    def locked_tokens(self) -> int:
        """Return the number of tokens in locked nodes."""
        return self._locked_tokens

    def tokens_on(self, tier: Tier) -> int:
        """Return the number of tokens the tree holds on ``tier``."""
        return self._tokens[tier]

    def nodes(self) -> Iterator[Node]:
        """Yield every node of every namespace, parents before children (roots left out)."""
        stack = [child for root in self._roots.values() for child in root._children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node._children.values())

    def path(self, node: Node) -> list[Node]:
        """Return the nodes from the namespace root (left out) down to ``node``."""
        out: list[Node] = []
        while node._parent is not None:
            out.append(node)
            node = node._parent
        out.reverse()
        return out

    # ---- matching and inserting ----------------------------------------------------------------

    def match_prefix(
        self, tokens: Sequence[int], *, seed: str | None = None, touch: bool = True
    ) -> MatchResult:
        """Find the longest cached prefix of the whole pages of ``tokens`` in namespace ``seed``.

        A match that ends inside a node splits it at that page boundary. With ``touch`` (a
        request's hit), every matched node gets its hit count incremented and its access time
        set; without it (a second look for the same request) the nodes are left as they were.

        Parameters
        ----------
        tokens
            Token ids of the request; a trailing partial page never matches.
        seed
            Namespace seed (the prior hash of the first page), ``None`` for no namespace.

        Returns
        -------
        MatchResult
            The device-ready prefix, the host-only stretch after it and the remainder's hashes.
        """
        toks = _as_tokens(tokens)
        end = self._aligned(len(toks))
        now = self._clock()
        node = self._root(seed)
        pos = 0
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        host_nodes: list[Node] = []
        device_node = node
        while pos < end:
            child = self._descend(node, toks, pos, end)
            if child is None:
                break
            if touch:
                child._hit_count += 1
                child._last_access = now
            if child._device is not None:
                device.append(child._device)
                device_node = child
            else:
                assert child._host is not None  # rule 3
                host.append(child._host)
                host_nodes.append(child)
            node = child
            pos += child.num_tokens
        return MatchResult(
            _cat(device),
            device_node,
            tuple(host_nodes),
            _cat(host),
            toks[pos:end],
            self._page_size,
            node.last_hash,
        )

    def insert(
        self, tokens: Sequence[int], device_indices: torch.Tensor, *, seed: str | None = None
    ) -> InsertResult:
        """Put the whole pages of ``tokens`` on the device, reusing the nodes already there.

        Nodes on the path that are on the host only take the caller's device slots (its KV is
        as good as a load), new nodes are made for the rest; every node on the path gets its
        access time set.

        Parameters
        ----------
        tokens
            Token ids from the start of the namespace; a trailing partial page is left out.
        device_indices
            Device slot of each token, ``len(tokens)`` of them.
        seed
            Namespace seed, ``None`` for no namespace.

        Returns
        -------
        InsertResult
            The last node and how many leading tokens were on the device already.
        """
        toks = _as_tokens(tokens)
        _check_indices(device_indices, len(toks), "device_indices")
        return self._insert(self._root(seed), toks, device_indices, Tier.DEVICE, stored=False)

    def insert_host(
        self,
        anchor: Node,
        tokens: Sequence[int],
        host_indices: torch.Tensor,
        *,
        stored: bool = False,
    ) -> InsertResult:
        """Put pages fetched from storage on the host, below ``anchor``.

        Nodes on the path that are not on the host take the caller's host slots, new nodes are
        made for the rest.

        Parameters
        ----------
        anchor
            Node the tokens follow: a namespace root or a node on the host (rule 4), typically
            :attr:`MatchResult.last_node`, locked while the fetch ran.
        tokens
            Token ids following ``anchor``; a trailing partial page is left out.
        host_indices
            Host slot of each token, ``len(tokens)`` of them.
        stored
            Mark every node of the inserted stretch as held by storage.

        Returns
        -------
        InsertResult
            The last node and how many leading tokens were on the host already.

        Raises
        ------
        RadixTreeError
            ``anchor`` is not in the tree or not on the host.
        """
        toks = _as_tokens(tokens)
        _check_indices(host_indices, len(toks), "host_indices")
        start = self._root(anchor._namespace) if anchor.is_root else anchor
        self._require_node(start)
        if start._host is None and not start.is_root:
            raise RadixTreeError(f"{anchor!r} is not on the host: attach its host indices first")
        return self._insert(start, toks, host_indices, Tier.HOST, stored=stored)

    # ---- locks ---------------------------------------------------------------------------------

    def lock(self, node: Node, *, host: bool = True) -> None:
        """Pin ``node`` and its ancestors on every tier until :meth:`unlock` (roots: no-op).

        With ``host=False`` the lock keeps what is on the device and every node in the tree,
        but not the host copy of a node that is on the device and stored (rule 5): a request
        computing from the device never reads it, and while the request runs its room can take
        fetched pages and pages waiting to be written.
        """
        self._require_node(node)
        for n in self._ancestry(node):
            if n._lock_ref == 0:
                self._locked_tokens += n.num_tokens
            n._lock_ref += 1
            n._host_locks += host
            self._refresh(n)

    def unlock(self, node: Node, *, host: bool = True) -> None:
        """Release one lock taken by :meth:`lock` on ``node`` with the same ``host``.

        Raises
        ------
        RadixTreeError
            ``node`` holds no such lock.
        """
        if not node.is_root and (node._lock_ref == 0 or (host and node._host_locks == 0)):
            raise RadixTreeError(f"{node!r} is not locked: unlock without a matching lock")
        if not node.is_root and not host and node._lock_ref == node._host_locks:
            raise RadixTreeError(f"{node!r} holds no host=False lock to release")
        for n in self._ancestry(node):
            n._lock_ref -= 1
            n._host_locks -= host
            if n._lock_ref == 0:
                self._locked_tokens -= n.num_tokens
            self._refresh(n)

    def pin_host(self, node: Node) -> None:
        """Keep ``node``'s host copy (and so its ancestors') until :meth:`unpin_host`.

        Raises
        ------
        RadixTreeError
            ``node`` is a root, not in the tree or not on the host.
        """
        self._require_node(node, kv=True)
        if node._host is None:
            raise RadixTreeError(f"{node!r} is not on the host; only a host copy can be pinned")
        node._host_pins += 1
        self._refresh(node)

    def unpin_host(self, node: Node) -> None:
        """Release one :meth:`pin_host` pin of ``node``.

        Raises
        ------
        RadixTreeError
            ``node`` holds no host pin.
        """
        if node._host_pins == 0:
            raise RadixTreeError(f"{node!r} has no host pin: unpin without a matching pin")
        node._host_pins -= 1
        self._refresh(node)

    # ---- tier transitions ----------------------------------------------------------------------

    def attach_device(self, node: Node, device_indices: torch.Tensor) -> None:
        """Record that the caller loaded a host-only node's KV into ``device_indices`` (L2→L1).

        Raises
        ------
        RadixTreeError
            The node is on the device already, or its parent is not (load top-down).
        """
        self._attach(node, device_indices, Tier.DEVICE)

    def attach_host(self, node: Node, host_indices: torch.Tensor) -> None:
        """Record that the caller backed a node up into ``host_indices`` (L1→L2).

        Raises
        ------
        RadixTreeError
            The node is on the host already, or its parent is not (back up top-down).
        """
        self._attach(node, host_indices, Tier.HOST)

    def mark_stored(self, node: Node, *, stored: bool = True) -> None:
        """Record whether storage holds every page of ``node`` (under ``node.hashes``)."""
        self._require_node(node, kv=True)
        if node._stored != stored:
            node._stored = stored
            self._tokens[Tier.STORAGE] += node.num_tokens if stored else -node.num_tokens
            self._refresh(node)

    def evict_device(self, node: Node) -> torch.Tensor:
        """Drop ``node`` from the device; a node then on no tier is removed from the tree.

        Returns
        -------
        torch.Tensor
            The device slots freed, for the caller to release.

        Raises
        ------
        RadixTreeError
            The node is not on the device, is locked, or has a child on the device.
        """
        return self._evict(node, Tier.DEVICE)

    def evict_host(self, node: Node) -> torch.Tensor:
        """Drop ``node`` from the host; a node then on no tier is removed from the tree.

        Returns
        -------
        torch.Tensor
            The host slots freed, for the caller to release.

        Raises
        ------
        RadixTreeError
            The node is not on the host, is locked, or has a child on the host.
        """
        return self._evict(node, Tier.HOST)

    def evictable(self, tier: Tier) -> Iterator[Node]:
        """Yield the nodes the caller may evict from ``tier``, least recently used first.

        The candidates are the unlocked nodes on ``tier`` with no child on it. The order is
        the one at the call; a parent that becomes a candidate because the caller evicted the
        node just yielded follows in its turn, and a node that stopped being a candidate is
        skipped.

        Raises
        ------
        RadixTreeError
            ``tier`` is storage, which evicts by itself.
        """
        candidates = self._candidates.get(tier)
        if candidates is None:
            raise RadixTreeError(f"the tree does not evict from {tier.value}; storage does")
        heap = [(n._last_access, n._id, n) for n in candidates]
        heapq.heapify(heap)
        return _least_recent(heap, candidates)

    # ---- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Verify every rule of the module docstring and every counter.

        Raises
        ------
        AssertionError
            A rule or counter does not hold (a bug in the tree).
        """
        totals = dict.fromkeys(Tier, 0)
        locked = 0
        seen: dict[Tier, list[torch.Tensor]] = {Tier.DEVICE: [], Tier.HOST: []}
        for seed, root in self._roots.items():
            _ensure(root.is_root and root._in_tree and root._namespace == seed, f"root {root!r}")
            _ensure(bool(root._children), f"registered root {root!r} has no children")
            _ensure(root._lock_ref == 0 and not root.tiers, f"root {root!r} holds state")
        nodes = set(self.nodes())
        for tier, candidates in self._candidates.items():
            _ensure(candidates <= nodes, f"a {tier.value} eviction candidate left the tree")
        for node in nodes:
            self._check_node(node, seen)
            for tier in node.tiers:
                totals[tier] += node.num_tokens
            locked += node.num_tokens if node._lock_ref else 0
        _ensure(totals == self._tokens, f"tier counters {self._tokens} != {totals}")
        _ensure(locked == self._locked_tokens, f"locked {self._locked_tokens} != {locked}")
        for tier, indices in seen.items():
            flat = _cat(indices)
            _ensure(len(set(flat.tolist())) == flat.numel(), f"a {tier.value} slot is used twice")

    def _check_node(self, node: Node, seen: dict[Tier, list[torch.Tensor]]) -> None:
        """Verify the rules that concern ``node`` and its link to its parent."""
        parent = node._parent
        ps = self._page_size
        if parent is None or not node._in_tree:
            raise AssertionError(f"{node!r} is detached")
        n = node.num_tokens
        _ensure(n > 0 and n % ps == 0, f"{node!r} does not hold whole pages")
        _ensure(parent._children.get(node._tokens[:ps]) is node, f"{node!r} badly keyed")
        _ensure(node._namespace == parent._namespace, f"{node!r} left its namespace")
        hashes = tuple(page_hashes(node._tokens, ps, parent.last_hash))
        _ensure(node._hashes == hashes, f"{node!r} has stale hashes")
        _ensure(node._device is not None or node._host is not None, f"{node!r} on no tier")
        _ensure(node._host_pins == 0 or node._host is not None, f"{node!r} pinned off the host")
        for tier, own, up in (
            (Tier.DEVICE, node._device, parent._device),
            (Tier.HOST, node._host, parent._host),
        ):
            if own is None:
                continue
            seen[tier].append(own)
            _ensure(
                own.dtype == torch.int64 and own.shape == (n,) and own.device.type == "cpu",
                f"{node!r} has malformed {tier.value} indices",
            )
            _ensure(parent.is_root or up is not None, f"{node!r} on {tier.value}, parent not")
        counts = (
            sum(c._device is not None for c in node._children.values()),
            sum(c._host is not None for c in node._children.values()),
        )
        _ensure(counts == (node._device_children, node._host_children), f"{node!r} counts")
        below = sum(c._lock_ref for c in node._children.values())
        _ensure(node._lock_ref >= below, f"{node!r} has fewer locks than its children")
        host_below = sum(c._host_locks for c in node._children.values())
        _ensure(
            host_below <= node._host_locks <= node._lock_ref,
            f"{node!r} counts host-keeping locks wrongly",
        )
        for tier, candidates in self._candidates.items():
            want = _is_candidate(node, tier)
            _ensure((node in candidates) == want, f"{node!r} candidacy for {tier.value}")

    # ---- internals -----------------------------------------------------------------------------

    def _aligned(self, length: int) -> int:
        """Return ``length`` rounded down to whole pages."""
        return length - length % self._page_size

    def _root(self, seed: str | None) -> Node:
        """Return the registered root of ``seed``, or a fresh unregistered one."""
        root = self._roots.get(seed)
        if root is None:
            root = Node(next(self._ids), (), None, seed, (), 0.0)
        return root

    def _descend(self, node: Node, toks: _Page, pos: int, end: int) -> Node | None:
        """Return the child of ``node`` matching ``toks[pos:end]``, split to the common pages."""
        ps = self._page_size
        child = node._children.get(toks[pos : pos + ps])
        if child is None:
            return None
        limit = min(child.num_tokens, end - pos)
        common = ps
        while (
            common < limit
            and child._tokens[common : common + ps] == toks[pos + common : pos + common + ps]
        ):
            common += ps
        return self._split(child, common) if common < child.num_tokens else child

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` tokens; the new upper half is returned."""
        parent = node._parent
        assert parent is not None
        pages = at // self._page_size
        head = Node(
            next(self._ids),
            node._tokens[:at],
            parent,
            node._namespace,
            node._hashes[:pages],
            node._last_access,
        )
        head._in_tree = True
        head._stored = node._stored
        head._lock_ref = node._lock_ref
        head._host_locks = node._host_locks
        head._hit_count = node._hit_count
        if node._device is not None:
            head._device, node._device = node._device[:at], node._device[at:]
            head._device_children = 1
        if node._host is not None:
            head._host, node._host = node._host[:at], node._host[at:]
            head._host_children = 1
        parent._children[head._tokens[: self._page_size]] = head
        node._tokens = node._tokens[at:]
        node._hashes = node._hashes[pages:]
        node._parent = head
        head._children[node._tokens[: self._page_size]] = node
        return head

    def _insert(
        self, start: Node, toks: _Page, indices: torch.Tensor, tier: Tier, *, stored: bool
    ) -> InsertResult:
        """Walk or build the path of ``toks`` below ``start``, putting it on ``tier``."""
        end = self._aligned(len(toks))
        now = self._clock()
        node = start
        pos = 0
        existing = 0
        while pos < end:
            child = self._descend(node, toks, pos, end)
            if child is None:
                child = self._new_child(node, toks[pos:end], now)
            stop = pos + child.num_tokens
            if _tier_indices(child, tier) is None:
                self._set(child, tier, indices[pos:stop].clone())
            else:
                existing = stop
            if stored:
                self.mark_stored(child)
            child._last_access = now
            node = child
            pos = stop
        return InsertResult(node, existing)

    def _new_child(self, parent: Node, tokens: _Page, now: float) -> Node:
        """Hang a node with no KV yet below ``parent``; the caller gives it a tier at once."""
        hashes = tuple(page_hashes(tokens, self._page_size, parent.last_hash))
        node = Node(next(self._ids), tokens, parent, parent._namespace, hashes, now)
        node._in_tree = True
        parent._children[tokens[: self._page_size]] = node
        if parent.is_root and not parent._in_tree:
            parent._in_tree = True
            self._roots[parent._namespace] = parent
        return node

    def _attach(self, node: Node, indices: torch.Tensor, tier: Tier) -> None:
        """Put a node already in the tree on ``tier`` (rule 4: its parent must be there)."""
        self._require_node(node, kv=True)
        _check_indices(indices, node.num_tokens, f"{tier.value} indices")
        if _tier_indices(node, tier) is not None:
            raise RadixTreeError(f"{node!r} is on the {tier.value} already")
        parent = node._parent
        assert parent is not None
        if not parent.is_root and _tier_indices(parent, tier) is None:
            raise RadixTreeError(
                f"the parent of {node!r} is not on the {tier.value}: attach from the top down"
            )
        self._set(node, tier, indices.clone())

    def _evict(self, node: Node, tier: Tier) -> torch.Tensor:
        """Take ``node`` off ``tier``, removing it when it is then on no tier."""
        self._require_node(node, kv=True)
        freed = _tier_indices(node, tier)
        if freed is None:
            raise RadixTreeError(f"{node!r} is not on the {tier.value}")
        if node._lock_ref and not (tier is Tier.HOST and _host_unkept(node)):
            raise RadixTreeError(f"{node!r} is locked; unlock it before evicting")
        if tier is Tier.HOST and node._host_pins:
            raise RadixTreeError(f"{node!r} has its host copy pinned; unpin it before evicting")
        if (node._device_children if tier is Tier.DEVICE else node._host_children) > 0:
            raise RadixTreeError(
                f"{node!r} has a child on the {tier.value}: evict the leaves of that tier first"
            )
        self._set(node, tier, None)
        if node._device is None and node._host is None:
            self._remove(node)
        return freed

    def _set(self, node: Node, tier: Tier, indices: torch.Tensor | None) -> None:
        """Set a node's indices on ``tier``, keeping counters and eviction candidates current."""
        parent = node._parent
        assert parent is not None
        sign = 1 if indices is not None else -1
        if tier is Tier.DEVICE:
            node._device = indices
            parent._device_children += sign
        else:
            node._host = indices
            parent._host_children += sign
        self._tokens[tier] += sign * node.num_tokens
        self._refresh(node)
        self._refresh(parent)

    def _remove(self, node: Node) -> None:
        """Unhang a node on no tier (a leaf, by rules 3 and 4) from the tree."""
        parent = node._parent
        assert parent is not None
        del parent._children[node._tokens[: self._page_size]]
        node._in_tree = False
        if node._stored:
            self._tokens[Tier.STORAGE] -= node.num_tokens
        if parent.is_root and not parent._children:
            parent._in_tree = False
            del self._roots[parent._namespace]

    def _refresh(self, node: Node) -> None:
        """Recompute whether ``node`` is an eviction candidate of each tier."""
        for tier, candidates in self._candidates.items():
            if _is_candidate(node, tier):
                candidates.add(node)
            else:
                candidates.discard(node)

    def _ancestry(self, node: Node) -> Iterator[Node]:
        """Yield ``node`` and its ancestors, the root left out."""
        while node._parent is not None:
            yield node
            node = node._parent

    def _require_node(self, node: Node, *, kv: bool = False) -> None:
        """Refuse a node removed from the tree and, when ``kv``, a root (it holds no KV)."""
        if kv and node.is_root:
            raise RadixTreeError("a namespace root holds no KV")
        if not node.is_root and not node._in_tree:
            raise RadixTreeError(f"{node!r} was removed from the tree; lock nodes you keep")


def _least_recent(heap: list[tuple[float, int, Node]], candidates: set[Node]) -> Iterator[Node]:
    """Pop the candidates of ``heap``, queueing each parent that becomes one (see ``evictable``)."""
    queued = {entry[2] for entry in heap}
    while heap:
        node = heapq.heappop(heap)[2]
        if node not in candidates:
            continue
        yield node
        parent = node._parent
        if parent is not None and parent in candidates and parent not in queued:
            queued.add(parent)
            heapq.heappush(heap, (parent._last_access, parent._id, parent))


def _is_candidate(node: Node, tier: Tier) -> bool:
    """Return whether ``node`` may be evicted from ``tier`` (rule 6)."""
    if node._parent is None:
        return False
    if tier is Tier.DEVICE:
        return not node._lock_ref and node._device is not None and node._device_children == 0
    return (
        node._host is not None
        and node._host_children == 0
        and node._host_pins == 0
        and (not node._lock_ref or _host_unkept(node))
    )


def _host_unkept(node: Node) -> bool:
    """Whether ``node``'s locks leave its host copy evictable (rule 5).

    Every lock is ``host=False`` and the node is on the device and stored.
    """
    return node._host_locks == 0 and node._device is not None and node._stored


def _tier_indices(node: Node, tier: Tier) -> torch.Tensor | None:
    """Return a node's indices on the device or host tier."""
    return node._device if tier is Tier.DEVICE else node._host


def _as_tokens(tokens: Sequence[int]) -> _Page:
    """Convert token ids (ints, numpy or 0-d torch integers) to a tuple of ints, checking range.

    Checking first means that hashing, done midway through an insert, cannot fail.
    """
    toks = tuple(map(operator.index, tokens))
    if toks and (min(toks) < 0 or max(toks) >= _TOKEN_LIMIT):
        raise RadixTreeError(f"token ids must lie in [0, 2**63), got {min(toks)}..{max(toks)}")
    return toks


def _check_indices(indices: torch.Tensor, length: int, what: str) -> None:
    """Refuse indices that are not a 1-D CPU int64 tensor of ``length`` entries."""
    if indices.dtype != torch.int64 or indices.dim() != 1 or indices.device.type != "cpu":
        raise RadixTreeError(
            f"{what} must be a 1-D CPU int64 tensor, got dtype={indices.dtype}, "
            f"shape={tuple(indices.shape)}, device={indices.device}"
        )
    if indices.numel() != length:
        raise RadixTreeError(f"{what} has {indices.numel()} entries for {length} tokens")


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate index tensors; an empty int64 tensor when there are none."""
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _ensure(condition: bool, message: str) -> None:
    """Raise :class:`AssertionError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise AssertionError(message)
