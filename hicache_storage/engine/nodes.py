"""The radix tree's nodes, the tiers they name, and what the tree's calls return.

:class:`Node` is one block of whole pages of a prefix and the tiers holding its KV; it is
read-only from outside: only :class:`~hicache_storage.engine.radix.RadixTree` changes a node,
and the rules it keeps are :mod:`hicache_storage.engine.radix`'s. :class:`MatchResult` and
:class:`InsertResult` are what :meth:`RadixTree.match_prefix
<hicache_storage.engine.radix.RadixTree.match_prefix>` and :meth:`RadixTree.insert
<hicache_storage.engine.radix.RadixTree.insert>` return; a call that would break a rule raises
:class:`RadixTreeError`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from hicache_storage.errors import HiCacheError
from hicache_storage.keys import page_hashes

__all__ = ["InsertResult", "MatchResult", "Node", "RadixTreeError", "Tier"]

_Page = tuple[int, ...]


class RadixTreeError(HiCacheError, ValueError):
    """A call would break a rule of the radix tree (see the module docstring); nothing changed."""


class Tier(enum.Enum):
    """Where a node's KV can live."""

    DEVICE = "device"
    """L1: token slots of the device KV pool."""
    HOST = "host"
    """L2: token slots of the host KV pool."""
    STORAGE = "storage"
    """L3: objects of a storage backend, named by page hashes."""


class Node:
    """One block of whole pages of a prefix and the tiers holding its KV; read-only from outside.

    Only :class:`RadixTree` changes a node. A node removed from its tree keeps its last state
    and reports ``in_tree`` false.
    """

    __slots__ = (
        "_children",
        "_device",
        "_device_children",
        "_hashes",
        "_hit_count",
        "_host",
        "_host_children",
        "_host_locks",
        "_host_pins",
        "_id",
        "_in_tree",
        "_last_access",
        "_lock_ref",
        "_namespace",
        "_parent",
        "_stored",
        "_tokens",
    )

    def __init__(
        self,
        node_id: int,
        tokens: _Page,
        parent: Node | None,
        namespace: str | None,
        hashes: tuple[str, ...],
        now: float,
    ) -> None:
        self._id = node_id
        self._tokens = tokens
        self._parent = parent
        self._namespace = namespace
        self._hashes = hashes
        self._children: dict[_Page, Node] = {}
        self._device: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._stored = False
        self._device_children = 0
        self._host_children = 0
        self._host_pins = 0
        self._host_locks = 0
        self._lock_ref = 0
        self._hit_count = 0
        self._last_access = now
        self._in_tree = False

    @property
    def id(self) -> int:
        """Return the node's number, unique within its tree."""
        return self._id

    @property
    def tokens(self) -> _Page:
        """Return the token ids of this block (empty for a namespace root)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        """Return the number of tokens of this block."""
        return len(self._tokens)

    @property
    def parent(self) -> Node | None:
        """Return the parent node, ``None`` for a namespace root."""
        return self._parent

    @property
    def children(self) -> Mapping[_Page, Node]:
        """Return the children keyed by the tokens of their first page."""
        return MappingProxyType(self._children)

    @property
    def is_root(self) -> bool:
        """Return whether this is a namespace root."""
        return self._parent is None

    @property
    def in_tree(self) -> bool:
        """Return whether the node is still part of its tree (roots: whether registered)."""
        return self._in_tree

    @property
    def namespace(self) -> str | None:
        """Return the seed the hash chain of this node's namespace starts from."""
        return self._namespace

    @property
    def hashes(self) -> tuple[str, ...]:
        """Return the page hashes of this block, chained from the parent's last hash."""
        return self._hashes

    @property
    def last_hash(self) -> str | None:
        """Return the hash a child's chain continues from (a root's: its namespace seed)."""
        return self._hashes[-1] if self._hashes else self._namespace

    @property
    def device_indices(self) -> torch.Tensor | None:
        """Return the device slot of each token, ``None`` when not on the device."""
        return self._device

    @property
    def host_indices(self) -> torch.Tensor | None:
        """Return the host slot of each token, ``None`` when not on the host."""
        return self._host

    @property
    def stored(self) -> bool:
        """Return whether storage was told to hold every page of this block."""
        return self._stored

    @property
    def tiers(self) -> frozenset[Tier]:
        """Return the tiers holding this block's KV."""
        held = (self._device is not None, self._host is not None, self._stored)
        return frozenset(tier for tier, on in zip(Tier, held, strict=True) if on)

    @property
    def lock_ref(self) -> int:
        """Return the number of locks taken on this node or a descendant."""
        return self._lock_ref

    @property
    def host_pins(self) -> int:
        """Return how many :meth:`RadixTree.pin_host` pins hold the node's host copy."""
        return self._host_pins

    @property
    def hit_count(self) -> int:
        """Return how many prefix matches went through this block."""
        return self._hit_count

    @property
    def last_access(self) -> float:
        """Return the tree clock's time of the last match or insert through this block."""
        return self._last_access

    def __repr__(self) -> str:
        tiers = "+".join(sorted(t.value for t in self.tiers)) or "-"
        return (
            f"Node(id={self._id}, tokens={len(self._tokens)}, tiers={tiers}, "
            f"lock_ref={self._lock_ref}, in_tree={self._in_tree})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The cached part of a prefix, as :meth:`RadixTree.match_prefix` found it.

    Attributes
    ----------
    device_indices
        Device slots of the device-ready prefix, its tokens in order.
    device_node
        Last node of the device-ready prefix (the namespace root when it is empty).
    host_nodes
        The nodes after it, on the host only: loading them L2→L1 extends the device prefix.
    host_indices
        Host slots of ``host_nodes``, their tokens in order.
    remainder
        Tokens of the whole pages after the match (a trailing partial page is left out).
    """

    device_indices: torch.Tensor
    device_node: Node
    host_nodes: tuple[Node, ...]
    host_indices: torch.Tensor
    remainder: tuple[int, ...]
    _page_size: int = field(repr=False)
    _prior_hash: str | None = field(repr=False)

    @property
    def remainder_hashes(self) -> tuple[str, ...]:
        """Page hashes of :attr:`remainder` from the last matched node: what to ask storage.

        Hashed on request: the scheduler matches a request several times (at arrival, at
        admission, when it finishes) and asks storage only at arrival.
        """
        return tuple(page_hashes(self.remainder, self._page_size, self._prior_hash))

    @property
    def device_len(self) -> int:
        """Return the number of tokens ready on the device."""
        return int(self.device_indices.numel())

    @property
    def host_len(self) -> int:
        """Return the number of tokens after them that are on the host only."""
        return int(self.host_indices.numel())

    @property
    def matched_len(self) -> int:
        """Return the number of tokens matched in the tree."""
        return self.device_len + self.host_len

    @property
    def last_node(self) -> Node:
        """Return the last matched node: lock it while using or loading the match."""
        return self.host_nodes[-1] if self.host_nodes else self.device_node


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`RadixTree.insert` and :meth:`RadixTree.insert_host` did.

    Attributes
    ----------
    node
        Last node of the inserted prefix (the namespace root when it is empty).
    existing_len
        Leading tokens whose KV the tier already held: the caller frees its own slots for them.
        The tree took the slots of the following whole pages; a trailing partial page stays
        the caller's.
    """

    node: Node
    existing_len: int
