"""Model-based: random sequences of operations agree with a dictionary model.

Every batch read is compared slot by slot with the model, not only its leading run: a hit's
buffer (or page) holds a value the model allows, a miss's keeps its sentinel bytes, whether it
comes before the first miss or after it, and a v1 read leaves every page outside its batch
untouched.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hicache_storage.capabilities import Capabilities
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    _bytes,
    _indices,
    _pool,
    _sentinel_fill,
    fill_random,
    page_bytes,
    pages_mismatch,
    pool_pages,
    slot_problem,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.errors import UnsupportedOperationError

__all__ = ["TestStateMachine"]


def _leading_run(hits: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(hits) if not hit), len(hits))


_NAMES = st.sampled_from(["a", "b", "c", "d", "e"])
_VALUES = st.binary(min_size=1, max_size=96)
_MACHINES = itertools.count()
_PAGES = 8
"""Pages of the machine's host pool (MHA ``layer_first``: four buffers a page)."""
_FIRST_PAGE = st.integers(0, _PAGES - 1)


def _pages(first: int, count: int) -> list[int]:
    """Return ``count`` distinct pages, every third from ``first`` (out of order; shrinks fast)."""
    return [(first + 3 * i) % _PAGES for i in range(count)]


class _DictModelMachine(RuleBasedStateMachine):
    """The backend against a dict of candidate values per key."""

    factory: BackendFactory
    caps: Capabilities
    prefix: str

    def __init__(self) -> None:
        super().__init__()
        self.ks = Keyspace(f"{self.prefix}{next(_MACHINES)}-")
        self.backend = self.factory()
        self.model: dict[str, set[bytes]] = {}
        self.can_clear = True
        self.cleared_nonempty = False
        self.pool = _pool("mha", "layer_first", pages=_PAGES)
        self.backend.register_host_pool(self.pool)

    def _key(self, name: str) -> str:
        return self.ks(name)

    @rule(name=_NAMES, value=_VALUES)
    def set_value(self, name: str, value: bytes) -> None:
        key = self._key(name)
        assert self.backend.set(key, value) is True
        self.model.setdefault(key, set()).add(value)

    @rule(name=_NAMES)
    def get(self, name: str) -> None:
        key = self._key(name)
        got = self.backend.get(key)
        if key in self.model:
            assert got is not None and _bytes(got) in self.model[key]
        else:
            assert got is None

    @rule(name=_NAMES)
    def get_into(self, name: str) -> None:
        key = self._key(name)
        got = self.backend.get(key)
        if got is None:
            assert key not in self.model
            assert self.backend.get(key, bytearray(4)) is None
            return
        out = bytearray(len(_bytes(got)))
        assert self.backend.get(key, out) is out
        assert bytes(out) in self.model[key]

    @rule(name=_NAMES)
    def exists(self, name: str) -> None:
        key = self._key(name)
        assert self.backend.exists(key) is (key in self.model)

    @rule(names=st.lists(_NAMES, max_size=6))
    def batch_exists_prefix(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        expected = _leading_run([key in self.model for key in keys])
        assert self.backend.batch_exists(keys) == expected

    @rule(names=st.lists(_NAMES, max_size=6))
    def batch_get(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        sizes = []
        for key in keys:
            got = self.backend.get(key)
            sizes.append(8 if got is None else len(_bytes(got)))
        outs = [bytearray([SENTINEL]) * size for size in sizes]
        hits = self.backend.batch_get(keys, outs)
        assert hits == [key in self.model for key in keys]
        for i, (key, out, hit) in enumerate(zip(keys, outs, hits, strict=True)):
            if hit:
                assert bytes(out) in self.model[key], f"batch_get slot {i} ({key!r}): other bytes"
            else:
                problem = slot_problem(out, None)
                assert problem is None, f"batch_get slot {i} ({key!r}) of {hits}: {problem}"

    @rule(pairs=st.lists(st.tuples(_NAMES, _VALUES), max_size=4))
    def batch_set(self, pairs: list[tuple[str, bytes]]) -> None:
        keys = [self._key(name) for name, _ in pairs]
        assert self.backend.batch_set(keys, [value for _, value in pairs]) == [True] * len(keys)
        for key, (_, value) in zip(keys, pairs, strict=True):
            self.model.setdefault(key, set()).add(value)

    @rule(names=st.lists(_NAMES, max_size=4), first=_FIRST_PAGE, seed=st.integers(0, 2**16))
    def batch_set_v1(self, names: list[str], first: int, seed: int) -> None:
        """Write pages of fresh random bytes (objects of ``page_nbytes``, unlike ``set``'s)."""
        keys = [self._key(n) for n in names]
        fill_random(self.pool, seed)
        indices = _indices(self.pool, _pages(first, len(keys)))
        written = page_bytes(self.pool, indices)
        assert self.backend.batch_set_v1(keys, indices) == [True] * len(keys)
        for key, value in zip(keys, written, strict=True):
            self.model.setdefault(key, set()).add(value)

    @rule(names=st.lists(_NAMES, max_size=6), first=_FIRST_PAGE)
    def batch_get_v1(self, names: list[str], first: int) -> None:
        """Read into sentinel pages; compare every page of the pool with the model.

        A key whose candidates all have the page's size must hit, one with none must miss; a
        key written at both sizes may do either.
        """
        keys = [self._key(n) for n in names]
        _sentinel_fill(self.pool)
        expected = pool_pages(self.pool)
        pages = _pages(first, len(keys))
        hits = self.backend.batch_get_v1(keys, _indices(self.pool, pages))
        assert len(hits) == len(keys), f"batch_get_v1 of {len(keys)} keys returned {hits}"
        after = pool_pages(self.pool)
        for i, (key, hit, page) in enumerate(zip(keys, hits, pages, strict=True)):
            candidates = self.model.get(key, set())
            fitting = {value for value in candidates if len(value) == self.pool.page_nbytes}
            if hit:
                untouched = after[page] == expected[page]
                assert after[page] in fitting, (
                    f"batch_get_v1 answered {hits}: slot {i} ({key!r}) is a hit, but its page "
                    f"{page} {'was left untouched' if untouched else 'holds bytes never written'}"
                    f" ({len(fitting)} page-sized value(s) written to the key)"
                )
                expected[page] = after[page]
            else:
                assert not candidates or fitting != candidates, (
                    f"batch_get_v1 answered {hits}: slot {i} ({key!r}) missed a stored page"
                )
        problem = pages_mismatch(f"batch_get_v1 answering {hits}", self.pool, expected)
        assert problem is None, problem

    @precondition(lambda self: self.caps.delete)
    @rule(name=_NAMES)
    def delete(self, name: str) -> None:
        key = self._key(name)
        assert self.backend.delete(key) is (key in self.model)
        self.model.pop(key, None)

    @precondition(lambda self: self.can_clear)
    @rule()
    def clear(self) -> None:
        try:
            self.backend.clear()
        except UnsupportedOperationError:
            self.can_clear = False
            return
        for key in sorted(self.model):
            assert not self.backend.exists(key), f"exists({key!r}) is True after clear()"
            assert self.backend.get(key) is None, f"get({key!r}) returned a value after clear()"
        self.cleared_nonempty = self.cleared_nonempty or bool(self.model)
        self.model.clear()

    @precondition(lambda self: self.caps.persistent)
    @rule()
    def reopen(self) -> None:
        self.backend.close()
        self.backend = self.factory()
        self.backend.register_host_pool(self.pool)

    def teardown(self) -> None:
        try:
            if self.can_clear and not self.cleared_nonempty:
                # Every run clears a store that holds values, whatever steps were drawn.
                for name in ("a", "b"):
                    self.set_value(name, b"before clear " + name.encode())
                self.clear()
                self.batch_exists_prefix(["a", "b"])
                self.get("a")
            cleanup(self.factory, self.backend, self.ks)
        finally:
            self.backend.close()


class TestStateMachine:
    """Random sequences of operations agree with a dictionary model."""

    def test_state_machine_matches_dict_model(
        self,
        hicache_factory: BackendFactory,
        capabilities: Capabilities,
        k: Keyspace,
        request: pytest.FixtureRequest,
    ) -> None:
        profile = str(request.config.getoption("hicache_profile", default="ci") or "ci")
        machine = type(
            "DictModelMachine",
            (_DictModelMachine,),
            {"factory": hicache_factory, "caps": capabilities, "prefix": k.prefix},
        )
        run_state_machine_as_test(
            machine, settings=settings(parent=settings.get_profile(f"hicache-{profile}"))
        )
