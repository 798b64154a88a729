"""Model-based: random sequences of operations agree with a dictionary model."""

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
from hicache_storage.conformance.checks.common import _bytes
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.errors import UnsupportedOperationError

__all__ = ["TestStateMachine"]


def _leading_run(hits: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(hits) if not hit), len(hits))


_NAMES = st.sampled_from(["a", "b", "c", "d", "e"])
_VALUES = st.binary(min_size=1, max_size=96)
_MACHINES = itertools.count()


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
        outs = [bytearray(size) for size in sizes]
        hits = self.backend.batch_get(keys, outs)
        assert hits == [key in self.model for key in keys]
        for key, out, hit in zip(keys, outs, hits, strict=True):
            if hit:
                assert bytes(out) in self.model[key]

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
