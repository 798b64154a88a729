"""Fixtures of the conformance suite, brought in by ``from ...conformance.suite import *``.

The author provides one fixture, ``hicache_factory``, returning a
:class:`~hicache_storage.conformance.factory.BackendFactory`. Everything else is derived from it:

``backend``
    A fresh instance, closed after the test; the keys the test made are deleted (or the
    instance is cleared when it cannot delete).
``keyspace`` / ``k``
    Per-test key names under a random prefix, so tests never see each other's objects.
``capabilities``
    What the backend under test claims.
``hicache_capability_gate`` (autouse)
    Skips a test marked ``@pytest.mark.hicache_requires("persistent", ...)`` when the backend
    does not claim every named capability.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator

import pytest

from hicache_storage.backend import StorageBackend
from hicache_storage.capabilities import Capabilities, unbacked_claims
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.errors import UnsupportedOperationError
from hicache_storage.registry import get_spec

__all__ = [
    "Keyspace",
    "backend",
    "capabilities",
    "capabilities_of",
    "hicache_capability_gate",
    "k",
    "keyspace",
]

REQUIRES_MARKER = "hicache_requires"

_CAPABILITIES: dict[str, Capabilities] = {}


def _factory_id(factory: BackendFactory) -> str:
    return json.dumps([factory.name, factory.options], sort_keys=True, default=str)


def capabilities_of(factory: BackendFactory) -> Capabilities:
    """Return (and remember) the capabilities an instance of ``factory`` claims."""
    ident = _factory_id(factory)
    if ident not in _CAPABILITIES:
        with factory() as instance:
            _CAPABILITIES[ident] = instance.capabilities
    return _CAPABILITIES[ident]


def unbacked_claims_of(factory: BackendFactory) -> list[str]:
    """Return what ``factory``'s backend claims without implementing (see ``unbacked_claims``)."""
    return unbacked_claims(get_spec(factory.name).load_factory(), capabilities_of(factory))


class Keyspace:
    """Key names private to one test: ``ks("name")`` is ``<random prefix><name>``.

    Every key handed out is remembered in :attr:`used` so the test's objects can be removed.
    """

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix if prefix is not None else f"t{secrets.token_hex(6)}-"
        #: Every key handed out so far.
        self.used: set[str] = set()

    def __call__(self, name: str) -> str:
        """Return the key for ``name`` and remember it."""
        key = f"{self.prefix}{name}"
        self.used.add(key)
        return key

    def many(self, stem: str, n: int) -> list[str]:
        """Return ``n`` keys ``<stem>0`` .. ``<stem>{n-1}``."""
        return [self(f"{stem}{i}") for i in range(n)]


def cleanup(factory: BackendFactory, instance: StorageBackend | None, ks: Keyspace) -> None:
    """Remove the keys of ``ks``: through ``instance`` if open, else a fresh one if persistent."""
    caps = capabilities_of(factory)
    opened = None
    if instance is None or instance.closed:
        if not caps.persistent:
            return
        instance = opened = factory()
    try:
        if caps.delete:
            for key in sorted(ks.used):
                instance.delete(key)
        else:
            with contextlib.suppress(UnsupportedOperationError):
                instance.clear()
    finally:
        if opened is not None:
            opened.close()


@pytest.fixture
def keyspace() -> Keyspace:
    """Per-test key names under a random prefix."""
    return Keyspace()


@pytest.fixture
def k(keyspace: Keyspace) -> Keyspace:
    """Shorthand for :func:`keyspace`: ``k("a")`` is this test's key ``a``."""
    return keyspace


@pytest.fixture
def capabilities(hicache_factory: BackendFactory) -> Capabilities:
    """Return what the backend under test claims (a backend that cannot be built errors)."""
    return capabilities_of(hicache_factory)


@pytest.fixture
def backend(hicache_factory: BackendFactory, keyspace: Keyspace) -> Iterator[StorageBackend]:
    """Yield a fresh layered instance; remove the test's keys and close it afterwards."""
    instance = hicache_factory()
    try:
        yield instance
    finally:
        try:
            cleanup(hicache_factory, instance, keyspace)
        finally:
            instance.close()


@pytest.fixture(autouse=True)
def hicache_capability_gate(request: pytest.FixtureRequest) -> None:
    """Skip a test whose ``hicache_requires`` capabilities the backend does not claim."""
    # Asked for every check, so a backend that cannot be built errors everywhere, never skips.
    factory: BackendFactory = request.getfixturevalue("hicache_factory")
    unbacked = unbacked_claims_of(factory)
    if unbacked:
        pytest.fail("; ".join(unbacked) + ": drop the claim or implement the method", False)
    claimed = set(capabilities_of(factory).claimed())
    required: list[str] = []
    for marker in request.node.iter_markers(REQUIRES_MARKER):
        required.extend(str(name) for name in marker.args)
    for name in required:
        if name not in claimed:
            pytest.skip(f"backend does not claim capability {name!r}")
