"""Host-only pins of the radix tree: a pinned host copy stays, the device copy stays evictable."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hicache_storage.engine.radix import Node, RadixTree, RadixTreeError, Tier

PS = 2


class FakeClock:
    """A clock that ticks once per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def span(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64)


def on_both(tree: RadixTree, tokens: Sequence[int], host_base: int = 100) -> Node:
    """Insert ``tokens`` on the device and back every node of their path up to the host."""
    node = tree.insert(tokens, span(0, len(tokens))).node
    for step in tree.path(node):
        if step.host_indices is None:
            start = (
                host_base
                + len(tuple(t for n in tree.path(step) for t in n.tokens))
                - step.num_tokens
            )
            tree.attach_host(step, span(start, start + step.num_tokens))
    return node


def evictable(tree: RadixTree, tier: Tier) -> set[Node]:
    return set(tree.evictable(tier))


def drain(tree: RadixTree, tier: Tier) -> list[int]:
    """Evict everything ``tier`` lets go, in the tree's order; return the ids evicted."""
    out = []
    for node in tree.evictable(tier):
        out.append(node.id)
        if tier is Tier.HOST:
            tree.evict_host(node)
        else:
            tree.evict_device(node)
    return out


@pytest.fixture
def tree() -> RadixTree:
    return RadixTree(PS, clock=FakeClock())


def test_pin_host_keeps_the_host_copy_but_leaves_the_device_copy_evictable(
    tree: RadixTree,
) -> None:
    node = on_both(tree, [1, 2, 3, 4])
    assert evictable(tree, Tier.HOST) == {node} and evictable(tree, Tier.DEVICE) == {node}
    tree.pin_host(node)
    assert node.host_pins == 1
    assert evictable(tree, Tier.HOST) == set()
    assert evictable(tree, Tier.DEVICE) == {node}
    with pytest.raises(RadixTreeError, match="pinned"):
        tree.evict_host(node)
    assert node.host_indices is not None, "a refused eviction changes nothing"
    tree.check()
    freed = tree.evict_device(node)
    assert freed.tolist() == [0, 1, 2, 3]
    assert node.in_tree and node.tiers == {Tier.HOST} and node.host_pins == 1
    assert evictable(tree, Tier.HOST) == set()
    tree.check()
    tree.unpin_host(node)
    assert evictable(tree, Tier.HOST) == {node}
    assert tree.evict_host(node).tolist() == [100, 101, 102, 103]
    assert not node.in_tree
    tree.check()


def test_a_pinned_host_copy_keeps_its_ancestors_on_the_host(tree: RadixTree) -> None:
    parent = on_both(tree, [1, 2, 3, 4])
    child = on_both(tree, [1, 2, 3, 4, 5, 6])
    assert child.parent is parent
    tree.pin_host(child)
    assert evictable(tree, Tier.HOST) == set()
    with pytest.raises(RadixTreeError, match="child on the host"):
        tree.evict_host(parent)
    # Every device copy may still go, leaves first.
    assert [n.id for n in tree.evictable(Tier.DEVICE)] == [child.id]
    tree.evict_device(child)
    assert evictable(tree, Tier.DEVICE) == {parent}
    tree.evict_device(parent)
    assert {parent.tiers, child.tiers} == {frozenset({Tier.HOST})}
    tree.check()
    tree.unpin_host(child)
    assert drain(tree, Tier.HOST) == [child.id, parent.id]
    assert list(tree.nodes()) == []
    tree.check()


def test_pins_count_and_unpin_without_a_pin_raises(tree: RadixTree) -> None:
    node = on_both(tree, [1, 2])
    with pytest.raises(RadixTreeError, match="no host pin"):
        tree.unpin_host(node)
    tree.pin_host(node)
    tree.pin_host(node)
    tree.unpin_host(node)
    assert node.host_pins == 1 and evictable(tree, Tier.HOST) == set()
    tree.unpin_host(node)
    assert node.host_pins == 0 and evictable(tree, Tier.HOST) == {node}
    with pytest.raises(RadixTreeError, match="no host pin"):
        tree.unpin_host(node)
    assert node.host_pins == 0
    tree.check()


def test_pin_of_a_node_without_a_host_copy_raises(tree: RadixTree) -> None:
    node = tree.insert([1, 2, 3, 4], span(0, 4)).node
    with pytest.raises(RadixTreeError, match="not on the host"):
        tree.pin_host(node)
    assert node.host_pins == 0 and evictable(tree, Tier.DEVICE) == {node}
    root = node.parent
    assert root is not None and root.is_root
    with pytest.raises(RadixTreeError, match="root"):
        tree.pin_host(root)
    tree.evict_device(node)
    assert not node.in_tree
    with pytest.raises(RadixTreeError, match="removed"):
        tree.pin_host(node)
    tree.check()


def test_lock_and_pin_are_independent(tree: RadixTree) -> None:
    node = on_both(tree, [1, 2, 3, 4])
    tree.lock(node)
    tree.pin_host(node)
    tree.unlock(node)
    assert evictable(tree, Tier.DEVICE) == {node} and evictable(tree, Tier.HOST) == set()
    tree.lock(node)
    tree.unpin_host(node)
    assert evictable(tree, Tier.HOST) == set(), "still locked"
    tree.unlock(node)
    assert evictable(tree, Tier.HOST) == {node}
    tree.check()


def test_split_keeps_the_pin_on_the_lower_node_and_protects_its_new_parent(
    tree: RadixTree,
) -> None:
    node = on_both(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    tree.pin_host(node)
    end = tuple(t for n in tree.path(node) for t in n.tokens)
    match = tree.match_prefix([1, 2, 3, 4, 9, 9])  # ends inside the node: splits it at 4
    head = match.last_node
    assert head is not node and node.parent is head
    assert head.tokens == (1, 2, 3, 4) and node.tokens == (5, 6, 7, 8)
    assert tuple(t for n in tree.path(node) for t in n.tokens) == end, "same end position"
    assert node.host_pins == 1 and head.host_pins == 0
    assert head.host_indices is not None and node.host_indices is not None
    assert head.host_indices.tolist() == [100, 101, 102, 103]
    assert node.host_indices.tolist() == [104, 105, 106, 107]
    tree.check()
    assert evictable(tree, Tier.HOST) == set()
    with pytest.raises(RadixTreeError):
        tree.evict_host(head)
    with pytest.raises(RadixTreeError, match="pinned"):
        tree.evict_host(node)
    # The device copies go, the pinned host copies stay.
    for victim in tree.evictable(Tier.DEVICE):
        tree.evict_device(victim)
    assert tree.tokens_on(Tier.DEVICE) == 0 and tree.tokens_on(Tier.HOST) == 8
    tree.check()
    tree.unpin_host(node)  # the pin taken before the split is released on the same node
    assert drain(tree, Tier.HOST) == [node.id, head.id]
    assert list(tree.nodes()) == []
    tree.check()


def test_split_of_a_host_only_pinned_node_by_insert_host(tree: RadixTree) -> None:
    root_anchor = tree.match_prefix([]).last_node
    node = tree.insert_host(root_anchor, [1, 2, 3, 4, 5, 6], span(10, 16), stored=True).node
    tree.pin_host(node)
    # A second fetch of a diverging prefix splits the pinned node.
    other = tree.insert_host(root_anchor, [1, 2, 7, 7], span(20, 24)).node
    assert other.parent is not None and other.parent is node.parent
    head = node.parent
    assert head is not None and head.tokens == (1, 2) and head.host_pins == 0
    assert node.tokens == (3, 4, 5, 6) and node.host_pins == 1 and node.stored
    assert evictable(tree, Tier.HOST) == {other}
    tree.check()
