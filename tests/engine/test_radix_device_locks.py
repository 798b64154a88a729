"""Locks that keep the device copy alone (``lock(node, host=False)``): what a running request holds.

A request computes from the device copies of its prefix; a host copy of a node that is also on
the device and in storage is a third copy it never reads, so its lock leaves that copy
evictable. Every other copy the lock kept before, it keeps.
"""

from __future__ import annotations

import pytest

from hicache_storage.engine.radix import Node, RadixTree, RadixTreeError, Tier

from .test_radix_pins import PS, FakeClock, evictable, on_both


@pytest.fixture
def tree() -> RadixTree:
    return RadixTree(PS, clock=FakeClock())


def stored_on_both(tree: RadixTree, tokens: list[int]) -> Node:
    node = on_both(tree, tokens)
    for step in tree.path(node):
        if not step.is_root:
            tree.mark_stored(step)
    return node


def test_a_device_lock_leaves_the_host_copy_of_a_stored_node_evictable(tree: RadixTree) -> None:
    node = stored_on_both(tree, [1, 2, 3, 4])
    tree.lock(node, host=False)
    assert evictable(tree, Tier.DEVICE) == set(), "the device copy is what the lock keeps"
    assert evictable(tree, Tier.HOST) == {node}
    freed = tree.evict_host(node)
    assert freed.tolist() == [100, 101, 102, 103]
    assert node.in_tree and node.tiers == {Tier.DEVICE, Tier.STORAGE} and node.lock_ref == 1
    with pytest.raises(RadixTreeError, match="locked"):
        tree.evict_device(node)
    tree.check()
    tree.unlock(node, host=False)
    assert evictable(tree, Tier.DEVICE) == {node}
    tree.check()


def test_a_device_lock_walks_up_host_leaf_by_host_leaf(tree: RadixTree) -> None:
    parent = stored_on_both(tree, [1, 2, 3, 4])
    child = stored_on_both(tree, [1, 2, 3, 4, 5, 6])
    assert child.parent is parent
    tree.lock(child, host=False)
    assert evictable(tree, Tier.HOST) == {child}, "the parent keeps a child on the host"
    ordered = [n.id for n in tree.evictable(Tier.HOST)]
    for node_id in ordered:
        assert node_id == child.id
        tree.evict_host(child)
    assert evictable(tree, Tier.HOST) == {parent}
    tree.evict_host(parent)
    assert parent.tiers == child.tiers == {Tier.DEVICE, Tier.STORAGE}
    tree.check()


@pytest.mark.parametrize("case", ["unstored", "host only", "host lock", "pinned"])
def test_a_device_lock_keeps_every_host_copy_it_cannot_give_up(tree: RadixTree, case: str) -> None:
    node = stored_on_both(tree, [1, 2, 3, 4]) if case != "unstored" else on_both(tree, [1, 2])
    if case == "host only":
        tree.evict_device(node)
    tree.lock(node, host=False)
    if case == "host lock":
        tree.lock(node)
    if case == "pinned":
        tree.pin_host(node)
    assert evictable(tree, Tier.HOST) == set()
    with pytest.raises(RadixTreeError):
        tree.evict_host(node)
    assert node.host_indices is not None, "a refused eviction changes nothing"
    tree.check()


def test_marking_a_locked_node_stored_makes_its_host_copy_a_candidate(tree: RadixTree) -> None:
    node = on_both(tree, [1, 2, 3, 4])
    tree.lock(node, host=False)
    assert evictable(tree, Tier.HOST) == set()
    tree.mark_stored(node)
    assert evictable(tree, Tier.HOST) == {node}
    tree.mark_stored(node, stored=False)
    assert evictable(tree, Tier.HOST) == set()
    tree.check()


def test_a_host_keeping_lock_outlasts_a_device_lock_on_the_same_node(tree: RadixTree) -> None:
    node = stored_on_both(tree, [1, 2, 3, 4])
    tree.lock(node)
    tree.lock(node, host=False)
    assert evictable(tree, Tier.HOST) == set()
    tree.unlock(node)
    assert evictable(tree, Tier.HOST) == {node}
    tree.unlock(node, host=False)
    assert node.lock_ref == 0
    tree.check()


def test_unlock_must_name_the_kind_of_lock_it_releases(tree: RadixTree) -> None:
    node = stored_on_both(tree, [1, 2, 3, 4])
    tree.lock(node, host=False)
    with pytest.raises(RadixTreeError, match="not locked"):
        tree.unlock(node)
    tree.unlock(node, host=False)
    tree.lock(node)
    with pytest.raises(RadixTreeError, match="host=False"):
        tree.unlock(node, host=False)
    assert node.lock_ref == 1, "a refused unlock changes nothing"
    tree.unlock(node)
    tree.check()


def test_a_split_keeps_the_device_lock_on_both_halves(tree: RadixTree) -> None:
    node = stored_on_both(tree, [1, 2, 3, 4, 5, 6])
    tree.lock(node, host=False)
    head = tree.match_prefix([1, 2, 9, 9]).last_node  # ends inside the node: splits it
    assert head is node.parent and not head.is_root and head.num_tokens == PS
    assert head.lock_ref == node.lock_ref == 1
    tree.check()
    assert evictable(tree, Tier.HOST) >= {node}
    assert head not in evictable(tree, Tier.HOST), "it has children on the host"
    tree.evict_host(node)
    tree.unlock(node, host=False)
    assert head.lock_ref == node.lock_ref == 0
    tree.check()
