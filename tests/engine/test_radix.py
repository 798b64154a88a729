"""The engine's radix tree: behaviour, rules and a state machine against a per-page model."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache_storage.engine.radix import Node, RadixTree, RadixTreeError, Tier
from hicache_storage.errors import HiCacheError
from hicache_storage.keys import namespace_seed, page_hashes

PS = 2
SEED = namespace_seed("lora-a", None)


class FakeClock:
    """A clock that ticks once per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def idx(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def span(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64)


def prefix_of(tree: RadixTree, node: Node) -> tuple[int, ...]:
    return tuple(t for n in tree.path(node) for t in n.tokens)


@pytest.fixture
def tree() -> RadixTree:
    return RadixTree(PS, clock=FakeClock())


# ---- matching and inserting ----------------------------------------------------------------------


def test_match_prefix_on_empty_tree_gives_root_and_remainder_hashes(tree: RadixTree) -> None:
    res = tree.match_prefix([1, 2, 3, 4, 5])
    assert res.matched_len == 0 and res.device_indices.dtype == torch.int64
    assert res.last_node.is_root and res.device_node is res.last_node
    assert res.remainder_hashes == tuple(page_hashes([1, 2, 3, 4], PS))
    assert list(tree.nodes()) == []
    tree.check()


def test_insert_then_match_returns_device_indices_of_whole_pages(tree: RadixTree) -> None:
    ins = tree.insert([1, 2, 3, 4, 5], span(10, 15))
    assert ins.existing_len == 0 and ins.node.tokens == (1, 2, 3, 4)
    res = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert res.device_len == 4 and res.device_indices.tolist() == [10, 11, 12, 13]
    assert res.last_node is ins.node and res.host_nodes == ()
    assert res.remainder_hashes == tuple(page_hashes([1, 2, 3, 4, 5, 6], PS)[2:])
    assert ins.node.hashes == tuple(page_hashes([1, 2, 3, 4], PS))
    assert tree.tokens_on(Tier.DEVICE) == 4
    tree.check()


def test_match_prefix_ignores_a_trailing_partial_page(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4], span(0, 4))
    assert tree.match_prefix([1, 2, 3]).device_len == 2
    assert tree.match_prefix([1]).matched_len == 0


def test_match_prefix_counts_hits_and_sets_access_time(tree: RadixTree) -> None:
    node = tree.insert([1, 2, 3, 4], span(0, 4)).node
    before = node.last_access
    tree.match_prefix([1, 2, 3, 4])
    tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert node.hit_count == 2 and node.last_access > before


def test_match_inside_a_node_splits_it_keeping_every_tier_consistent(tree: RadixTree) -> None:
    node = tree.insert([1, 2, 3, 4, 5, 6], span(0, 6)).node
    tree.attach_host(node, span(100, 106))
    tree.mark_stored(node)
    tree.lock(node)
    res = tree.match_prefix([1, 2, 3, 4, 9, 9])
    head = res.last_node
    assert head is not node and node.parent is head and head.tokens == (1, 2, 3, 4)
    assert node.tokens == (5, 6)
    assert head.device_indices is not None and head.device_indices.tolist() == [0, 1, 2, 3]
    assert head.host_indices is not None and head.host_indices.tolist() == [100, 101, 102, 103]
    assert node.device_indices is not None and node.device_indices.tolist() == [4, 5]
    assert node.host_indices is not None and node.host_indices.tolist() == [104, 105]
    full = page_hashes([1, 2, 3, 4, 5, 6], PS)
    assert head.hashes == tuple(full[:2]) and node.hashes == tuple(full[2:])
    assert head.stored and node.stored and head.lock_ref == node.lock_ref == 1
    assert tree.locked_tokens == 6 and tree.tokens_on(Tier.STORAGE) == 6
    tree.check()
    tree.unlock(node)
    assert tree.locked_tokens == 0 and head.lock_ref == 0
    tree.check()


def test_insert_reuses_the_common_prefix_and_reports_existing_tokens(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4, 5, 6], span(0, 6))
    ins = tree.insert([1, 2, 3, 4, 7, 8, 9], span(50, 57))
    assert ins.existing_len == 4 and ins.node.tokens == (7, 8)
    assert ins.node.device_indices is not None and ins.node.device_indices.tolist() == [54, 55]
    assert tree.tokens_on(Tier.DEVICE) == 8
    again = tree.insert([1, 2, 3, 4, 7, 8], span(60, 66))
    assert again.existing_len == 6 and again.node is ins.node
    tree.check()


def test_insert_adopts_device_slots_for_nodes_on_the_host_only(tree: RadixTree) -> None:
    node = tree.insert([1, 2, 3, 4], span(0, 4)).node
    tree.attach_host(node, span(100, 104))
    assert tree.evict_device(node).tolist() == [0, 1, 2, 3]
    assert node.tiers == {Tier.HOST}
    ins = tree.insert([1, 2, 3, 4, 5, 6], span(20, 26))
    assert ins.existing_len == 0 and ins.node.tokens == (5, 6)
    assert node.device_indices is not None and node.device_indices.tolist() == [20, 21, 22, 23]
    assert node.tiers == {Tier.DEVICE, Tier.HOST}
    tree.check()


def test_insert_keeps_its_own_copy_of_the_indices(tree: RadixTree) -> None:
    slots = span(0, 4)
    node = tree.insert([1, 2, 3, 4], slots).node
    slots.fill_(-1)
    assert node.device_indices is not None and node.device_indices.tolist() == [0, 1, 2, 3]


def test_namespaces_never_share_nodes_and_seed_their_hash_chains(tree: RadixTree) -> None:
    plain = tree.insert([1, 2, 3, 4], span(0, 4)).node
    salted = tree.insert([1, 2, 3, 4], span(4, 8), seed=SEED).node
    assert plain is not salted and salted.namespace == SEED
    assert salted.hashes == tuple(page_hashes([1, 2, 3, 4], PS, SEED))
    assert tree.match_prefix([1, 2, 3, 4], seed=SEED).device_indices.tolist() == [4, 5, 6, 7]
    other = tree.match_prefix([1, 2, 3, 4], seed=namespace_seed(None, "tenant"))
    assert other.matched_len == 0 and other.last_node.is_root
    tree.evict_device(salted)
    assert not salted.in_tree and [n.namespace for n in tree.nodes()] == [None]
    tree.check()


# ---- tier transitions ----------------------------------------------------------------------------


def test_evict_device_of_a_backed_up_node_leaves_it_on_the_host(tree: RadixTree) -> None:
    top = tree.insert([1, 2], span(0, 2)).node
    leaf = tree.insert([1, 2, 3, 4], span(0, 4)).node
    tree.attach_host(top, span(100, 102))
    tree.attach_host(leaf, span(102, 104))
    assert tree.evict_device(leaf).tolist() == [2, 3]
    res = tree.match_prefix([1, 2, 3, 4])
    assert res.device_len == 2 and res.device_node is top and res.host_nodes == (leaf,)
    assert res.host_indices.tolist() == [102, 103] and res.last_node is leaf
    tree.attach_device(leaf, span(40, 42))
    assert tree.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [0, 1, 40, 41]
    tree.check()


def test_evict_device_of_a_node_on_no_other_tier_removes_it(tree: RadixTree) -> None:
    node = tree.insert([1, 2, 3, 4], span(0, 4)).node
    tree.mark_stored(node)
    assert tree.evict_device(node).tolist() == [0, 1, 2, 3]
    assert not node.in_tree and list(tree.nodes()) == []
    assert tree.tokens_on(Tier.STORAGE) == 0
    with pytest.raises(RadixTreeError, match="removed"):
        tree.lock(node)
    tree.check()


def test_evict_host_keeps_a_node_on_the_device_and_removes_a_host_only_one(
    tree: RadixTree,
) -> None:
    top = tree.insert([1, 2], span(0, 2)).node
    leaf = tree.insert([1, 2, 3, 4], span(0, 4)).node
    tree.attach_host(top, span(100, 102))
    tree.attach_host(leaf, span(102, 104))
    tree.evict_device(leaf)
    assert tree.evict_host(leaf).tolist() == [102, 103]
    assert not leaf.in_tree
    assert tree.evict_host(top).tolist() == [100, 101]
    assert top.in_tree and top.tiers == {Tier.DEVICE}
    tree.check()


def test_evictions_refuse_locked_nodes_and_nodes_with_a_child_on_the_tier(
    tree: RadixTree,
) -> None:
    top = tree.insert([1, 2], span(0, 2)).node
    leaf = tree.insert([1, 2, 3, 4], span(0, 4)).node
    with pytest.raises(RadixTreeError, match="child on the device"):
        tree.evict_device(top)
    tree.lock(leaf)
    with pytest.raises(RadixTreeError, match="locked"):
        tree.evict_device(leaf)
    with pytest.raises(RadixTreeError, match="not on the host"):
        tree.evict_host(leaf)
    assert tree.locked_tokens == 4 and top.lock_ref == 1
    tree.unlock(leaf)
    tree.evict_device(leaf)
    tree.evict_device(top)
    assert list(tree.nodes()) == []
    tree.check()


def test_attach_goes_top_down_and_refuses_a_tier_held_already(tree: RadixTree) -> None:
    top = tree.insert([1, 2], span(0, 2)).node
    leaf = tree.insert([1, 2, 3, 4], span(0, 4)).node
    with pytest.raises(RadixTreeError, match="top down"):
        tree.attach_host(leaf, span(102, 104))
    tree.attach_host(top, span(100, 102))
    tree.attach_host(leaf, span(102, 104))
    with pytest.raises(RadixTreeError, match="already"):
        tree.attach_host(leaf, span(104, 106))
    tree.evict_device(leaf)
    tree.evict_device(top)
    with pytest.raises(RadixTreeError, match="top down"):
        tree.attach_device(leaf, span(10, 12))
    tree.attach_device(top, span(8, 10))
    tree.attach_device(leaf, span(10, 12))
    tree.check()


def test_bad_indices_are_refused_without_changing_the_tree(tree: RadixTree) -> None:
    with pytest.raises(RadixTreeError, match="3 entries for 4 tokens"):
        tree.insert([1, 2, 3, 4], span(0, 3))
    with pytest.raises(RadixTreeError, match="int64"):
        tree.insert([1, 2], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RadixTreeError, match="1-D"):
        tree.insert([1, 2], span(0, 2).reshape(1, 2))
    assert list(tree.nodes()) == []
    node = tree.insert([1, 2], span(0, 2)).node
    with pytest.raises(RadixTreeError, match="token ids"):
        tree.insert([1, 2, 3, -4], span(10, 14))
    assert list(tree.nodes()) == [node] and node.last_access == 1.0
    with pytest.raises(HiCacheError):
        tree.attach_host(node, span(0, 3))
    assert node.tiers == {Tier.DEVICE}
    root = tree.match_prefix([]).last_node
    with pytest.raises(RadixTreeError, match="root"):
        tree.evict_device(root)


def test_unlock_without_lock_is_refused(tree: RadixTree) -> None:
    node = tree.insert([1, 2], span(0, 2)).node
    with pytest.raises(RadixTreeError, match="not locked"):
        tree.unlock(node)
    root = tree.match_prefix([1, 2]).device_node.parent
    assert root is not None and root.is_root
    tree.lock(root)
    tree.unlock(root)
    assert tree.locked_tokens == 0


# ---- storage prefetch landing on the host --------------------------------------------------------


def test_insert_host_hangs_fetched_pages_below_the_anchor(tree: RadixTree) -> None:
    node = tree.insert([1, 2, 3, 4], span(0, 4)).node
    tree.attach_host(node, span(100, 104))
    res = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    full = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PS)
    assert res.remainder_hashes == tuple(full[2:])
    ins = tree.insert_host(res.last_node, [5, 6, 7, 8, 9], span(200, 205), stored=True)
    assert ins.existing_len == 0 and ins.node.tiers == {Tier.HOST, Tier.STORAGE}
    assert ins.node.hashes == tuple(full[2:])
    again = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert again.device_len == 4 and again.host_indices.tolist() == [200, 201, 202, 203]
    assert tree.tokens_on(Tier.HOST) == 8 and tree.tokens_on(Tier.STORAGE) == 4
    tree.check()


def test_insert_host_adopts_host_slots_and_reports_pages_already_there(tree: RadixTree) -> None:
    root = tree.match_prefix([1, 2]).last_node
    first = tree.insert_host(root, [1, 2], span(100, 102))
    tree.insert([1, 2, 3, 4], span(0, 4))
    ins = tree.insert_host(root, [1, 2, 3, 4, 5, 6], span(200, 206))
    assert ins.existing_len == 2 and ins.node.tokens == (5, 6)
    mid = tree.match_prefix([1, 2, 3, 4]).last_node
    assert mid.parent is first.node and mid.tiers == {Tier.DEVICE, Tier.HOST}
    assert mid.host_indices is not None and mid.host_indices.tolist() == [202, 203]
    tree.check()


def test_insert_host_refuses_an_anchor_off_the_host(tree: RadixTree) -> None:
    node = tree.insert([1, 2], span(0, 2)).node
    with pytest.raises(RadixTreeError, match="not on the host"):
        tree.insert_host(node, [3, 4], span(100, 102))
    tree.evict_device(node)
    with pytest.raises(RadixTreeError, match="removed"):
        tree.insert_host(node, [3, 4], span(100, 102))


def test_roots_are_told_apart_by_their_seed_alone(tree: RadixTree) -> None:
    stale = tree.match_prefix([1, 2], seed=SEED).last_node
    fresh = tree.match_prefix([1, 2], seed=SEED).last_node
    tree.insert_host(fresh, [1, 2], span(100, 102))
    ins = tree.insert_host(stale, [1, 2, 3, 4], span(200, 204))
    assert ins.existing_len == 2 and prefix_of(tree, ins.node) == (1, 2, 3, 4)
    assert ins.node.namespace == SEED
    tree.check()


# ---- eviction order and counters -----------------------------------------------------------------


def test_evictable_yields_leaves_least_recently_used_first_then_parents(
    tree: RadixTree,
) -> None:
    tree.insert([1, 2, 3, 4], span(0, 4))
    tree.insert([1, 2, 5, 6], span(4, 8))
    tree.insert([7, 8], span(8, 10))
    tree.match_prefix([1, 2, 3, 4])
    order = []
    for node in tree.evictable(Tier.DEVICE):
        order.append(prefix_of(tree, node))
        tree.evict_device(node)
    assert order == [(1, 2, 5, 6), (7, 8), (1, 2, 3, 4), (1, 2)]
    assert list(tree.nodes()) == [] and tree.tokens_on(Tier.DEVICE) == 0
    tree.check()


def test_evictable_skips_locked_nodes_and_refuses_storage(tree: RadixTree) -> None:
    a = tree.insert([1, 2], span(0, 2)).node
    b = tree.insert([3, 4], span(2, 4)).node
    tree.attach_host(a, span(100, 102))
    tree.lock(a)
    assert list(tree.evictable(Tier.DEVICE)) == [b]
    assert list(tree.evictable(Tier.HOST)) == []
    tree.unlock(a)
    assert list(tree.evictable(Tier.HOST)) == [a]
    with pytest.raises(RadixTreeError, match="storage"):
        tree.evictable(Tier.STORAGE)


def test_check_catches_a_broken_counter(tree: RadixTree) -> None:
    tree.insert([1, 2], span(0, 2))
    tree._tokens[Tier.DEVICE] += 1
    with pytest.raises(AssertionError, match="tier counters"):
        tree.check()


# ---- state machine against a per-page model ------------------------------------------------------


@dataclass
class Page:
    """The model of one page: its slots on each tier and whether storage holds it."""

    device: list[int] | None = None
    host: list[int] | None = None
    stored: bool = False


Key = tuple[str | None, tuple[int, ...]]
ALPHABET = 2
TOKENS = st.lists(st.integers(0, ALPHABET - 1), max_size=9)
NEXT_PAGES = list(itertools.product(range(ALPHABET), repeat=PS))
SEEDS = st.sampled_from([None, SEED])


def page_keys(seed: str | None, tokens: Sequence[int]) -> list[Key]:
    whole = len(tokens) - len(tokens) % PS
    return [(seed, tuple(tokens[: end + PS])) for end in range(0, whole, PS)]


class RadixMachine(RuleBasedStateMachine):
    """The tree against a dict from each cached page (its whole prefix) to its tier state."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(PS, clock=FakeClock())
        self.model: dict[Key, Page] = {}
        self.slots = itertools.count()
        self.locks: list[tuple[Node, bool]] = []
        """Each lock's node and whether it keeps the host copy (``lock(node, host=...)``)."""

    # helpers

    def fresh(self, n: int) -> torch.Tensor:
        return idx([next(self.slots) for _ in range(n)])

    def keys_of(self, node: Node) -> list[Key]:
        prefix = prefix_of(self.tree, node)
        return page_keys(node.namespace, prefix)[-(node.num_tokens // PS) :]

    def slots_of(self, keys: list[Key], tier: Tier) -> list[int]:
        out: list[int] = []
        for key in keys:
            held = self.model[key].device if tier is Tier.DEVICE else self.model[key].host
            assert held is not None
            out += held
        return out

    def locked_keys(self, *, keeping_host: bool = False) -> set[Key]:
        out: set[Key] = set()
        for node, host in self.locks:
            if host or not keeping_host:
                out.update(page_keys(node.namespace, prefix_of(self.tree, node)))
        return out

    def held(self, key: Key, tier: Tier) -> bool:
        """Whether the locks keep ``key``'s page on ``tier`` (rule 5)."""
        if key not in self.locked_keys():
            return False
        if tier is Tier.DEVICE or key in self.locked_keys(keeping_host=True):
            return True
        page = self.model[key]
        return page.device is None or not page.stored

    def model_leaves(self, tier: Tier) -> set[Key]:

        def on(key: Key) -> bool:
            page = self.model.get(key)
            held = None if page is None else (page.device if tier is Tier.DEVICE else page.host)
            return held is not None

        return {
            key
            for key in self.model
            if on(key)
            and not self.held(key, tier)
            and not any(on((key[0], key[1] + page)) for page in NEXT_PAGES)
        }

    def model_match(self, seed: str | None, tokens: Sequence[int]) -> tuple[list[Key], list[Key]]:
        device: list[Key] = []
        host: list[Key] = []
        for key in page_keys(seed, tokens):
            page = self.model.get(key)
            if page is None:
                break
            if page.device is not None:
                assert not host, "device residency must be prefix-closed"
                device.append(key)
            else:
                host.append(key)
        return device, host

    def evict_on(self, tier: Tier) -> Callable[[Node], torch.Tensor]:
        return self.tree.evict_device if tier is Tier.DEVICE else self.tree.evict_host

    def attach_on(self, tier: Tier) -> Callable[[Node, torch.Tensor], None]:
        return self.tree.attach_device if tier is Tier.DEVICE else self.tree.attach_host

    def pick(self, data: st.DataObject, nodes: list[Node]) -> Node | None:
        return data.draw(st.sampled_from(nodes)) if nodes else None

    # rules

    @rule(seed=SEEDS, tokens=TOKENS)
    def insert(self, seed: str | None, tokens: list[int]) -> None:
        keys = page_keys(seed, tokens)
        slots = self.fresh(len(tokens))
        already = [k for k in keys if k in self.model and self.model[k].device is not None]
        res = self.tree.insert(tokens, slots, seed=seed)
        assert res.existing_len == PS * len(already) and keys[: len(already)] == already
        for i, key in enumerate(keys):
            page = self.model.setdefault(key, Page())
            if page.device is None:
                page.device = slots[i * PS : (i + 1) * PS].tolist()
        assert prefix_of(self.tree, res.node) == tuple(tokens[: PS * len(keys)])

    @rule(seed=SEEDS, tokens=TOKENS)
    def match(self, seed: str | None, tokens: list[int]) -> None:
        device, host = self.model_match(seed, tokens)
        res = self.tree.match_prefix(tokens, seed=seed)
        assert res.device_indices.tolist() == self.slots_of(device, Tier.DEVICE)
        assert res.host_indices.tolist() == self.slots_of(host, Tier.HOST)
        assert [k for n in res.host_nodes for k in self.keys_of(n)] == host
        matched = len(device) + len(host)
        full = page_hashes(tokens[: PS * len(page_keys(seed, tokens))], PS, seed)
        assert res.remainder_hashes == tuple(full[matched:])
        assert prefix_of(self.tree, res.last_node) == tuple(tokens[: PS * matched])
        assert res.last_node.last_hash == (full[matched - 1] if matched else seed)

    @rule(seed=SEEDS, tokens=TOKENS, pages=st.integers(0, 3), stored=st.booleans())
    def prefetch(self, seed: str | None, tokens: list[int], pages: int, stored: bool) -> None:
        res = self.tree.match_prefix(tokens, seed=seed)
        anchor = res.last_node
        fetched = tokens[res.matched_len : res.matched_len + PS * pages + 1]
        slots = self.fresh(len(fetched))
        if not anchor.is_root and anchor.host_indices is None:
            with pytest.raises(RadixTreeError, match="not on the host"):
                self.tree.insert_host(anchor, fetched, slots)
            return
        keys = page_keys(seed, tokens[: res.matched_len + len(fetched)])[res.matched_len // PS :]
        already = [k for k in keys if k in self.model and self.model[k].host is not None]
        ins = self.tree.insert_host(anchor, fetched, slots, stored=stored)
        assert ins.existing_len == PS * len(already) and keys[: len(already)] == already
        for i, key in enumerate(keys):
            page = self.model.setdefault(key, Page())
            if page.host is None:
                page.host = slots[i * PS : (i + 1) * PS].tolist()
            page.stored = page.stored or stored

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        node = self.pick(data, list(self.tree.nodes()))
        if node is not None:
            host = data.draw(st.booleans())
            self.tree.lock(node, host=host)
            self.locks.append((node, host))

    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        if self.locks:
            node, host = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
            self.tree.unlock(node, host=host)

    @rule(data=st.data(), tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict(self, data: st.DataObject, tier: Tier) -> None:
        candidates = list(self.tree.evictable(tier))
        ages = [(n.last_access, n.id) for n in candidates]
        assert ages == sorted(ages)
        assert {self.keys_of(n)[-1] for n in candidates} == self.model_leaves(tier)
        node = self.pick(data, candidates)
        if node is not None:
            self.evict_node(node, tier)

    @rule(tier=st.sampled_from([Tier.DEVICE, Tier.HOST]), budget=st.integers(1, 12))
    def evict_tokens(self, tier: Tier, budget: int) -> None:
        """Evict as a controller does: walk the candidates, parents included, until enough."""
        for node in self.tree.evictable(tier):
            if budget <= 0:
                break
            assert self.keys_of(node)[-1] in self.model_leaves(tier)
            budget -= node.num_tokens
            self.evict_node(node, tier)
        if budget > 0:
            assert not self.model_leaves(tier), "the walk stopped with candidates left"

    def evict_node(self, node: Node, tier: Tier) -> None:
        keys = self.keys_of(node)
        assert not any(self.held(key, tier) for key in keys), "a held copy is never evictable"
        want = self.slots_of(keys, tier)
        freed = self.evict_on(tier)(node)
        assert freed.tolist() == want
        for key in keys:
            page = self.model[key]
            if tier is Tier.DEVICE:
                page.device = None
            else:
                page.host = None
            if page.device is None and page.host is None:
                del self.model[key]
        assert node.in_tree == (keys[0] in self.model)

    @rule(data=st.data(), tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict_refused(self, data: st.DataObject, tier: Tier) -> None:
        candidates = set(self.tree.evictable(tier))
        node = self.pick(data, [n for n in self.tree.nodes() if n not in candidates])
        if node is None:
            return
        with pytest.raises(RadixTreeError):
            self.evict_on(tier)(node)

    @rule(data=st.data(), tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def attach(self, data: st.DataObject, tier: Tier) -> None:
        def on(node: Node | None) -> bool:
            return node is not None and (node.is_root or tier in node.tiers)

        node = self.pick(data, [n for n in self.tree.nodes() if tier not in n.tiers])
        if node is None:
            return
        slots = self.fresh(node.num_tokens)
        if not on(node.parent):
            with pytest.raises(RadixTreeError, match="top down"):
                self.attach_on(tier)(node, slots)
            return
        self.attach_on(tier)(node, slots)
        keys = self.keys_of(node)
        for i, key in enumerate(keys):
            part = slots[i * PS : (i + 1) * PS].tolist()
            if tier is Tier.DEVICE:
                self.model[key].device = part
            else:
                self.model[key].host = part

    @rule(data=st.data(), stored=st.booleans())
    def mark_stored(self, data: st.DataObject, stored: bool) -> None:
        node = self.pick(data, list(self.tree.nodes()))
        if node is not None:
            self.tree.mark_stored(node, stored=stored)
            for key in self.keys_of(node):
                self.model[key].stored = stored

    # invariants

    @invariant()
    def agrees_with_model(self) -> None:
        self.tree.check()
        seen: set[Key] = set()
        for node in self.tree.nodes():
            prefix = prefix_of(self.tree, node)
            full = page_hashes(prefix, PS, node.namespace)
            assert node.hashes == tuple(full[-len(node.hashes) :])
            for i, key in enumerate(self.keys_of(node)):
                page = self.model[key]
                part = slice(i * PS, (i + 1) * PS)
                device, host = node.device_indices, node.host_indices
                assert (None if device is None else device[part].tolist()) == page.device
                assert (None if host is None else host[part].tolist()) == page.host
                assert node.stored == page.stored
                seen.add(key)
        assert seen == set(self.model)
        pages = self.model.values()
        assert self.tree.tokens_on(Tier.DEVICE) == PS * sum(p.device is not None for p in pages)
        assert self.tree.tokens_on(Tier.HOST) == PS * sum(p.host is not None for p in pages)
        assert self.tree.tokens_on(Tier.STORAGE) == PS * sum(p.stored for p in pages)
        assert self.tree.locked_tokens == PS * len(self.locked_keys())


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
