"""The conformance checks: ``from hicache_storage.conformance.suite import *`` in a test module.

The module must also define one fixture, ``hicache_factory``, returning a
:class:`~hicache_storage.conformance.factory.BackendFactory` (the pytest plugin provides it when
``--hicache-backend`` is given). Checks tied to a capability carry
``@pytest.mark.hicache_requires(...)`` and skip, naming the capability, when it is not claimed.
A backend that cannot be built makes the checks error, never skip.

This module is what pytest collects; the checks live by area in
:mod:`hicache_storage.conformance.checks`: ``core`` (round trips, misses, idempotent writes),
``sizes`` (value sizes, key shapes), ``batch`` (batches, prefix hits), ``zerocopy`` (v1 page
I/O, model-sized pages, native zero-copy, unified objects, buffer sizes),
``bad_input``, ``lifecycle``, ``close_race`` (``close()`` under load), ``concurrency``,
``sharing`` (several processes, persistence),
``capacity`` (bounds, delete), ``stats``, ``crash``, ``faults`` (injected and server faults),
``deadline`` (nothing a call does after it returned), ``endtoend`` (page hits verified
against the bytes written for their keys),
``resources`` (descriptors and threads on error paths and racing first calls), ``integrity``
(corrupted bytes are misses, reused identities), ``formats`` (a reader of another model format
never hits), ``isolation`` (namespaces, secrets) and ``model``
(the state machine), with what they share in ``common``.
"""

# ruff: noqa: E402 - the checks are imported after they are marked for assertion rewriting
from __future__ import annotations

import pytest

from hicache_storage.conformance import fixtures as _fixtures
from hicache_storage.conformance.fixtures import *  # noqa: F403

# pytest rewrites the asserts of the module it collects (this one), not of what it imports: mark
# the checks too, so a failed check reports the values it compared, as it did when it lived here.
pytest.register_assert_rewrite("hicache_storage.conformance.checks")

# pytest runs the checks in the order their classes are bound here: keep it the order of __all__.
# isort: off
from hicache_storage.conformance.checks.core import TestRoundTrip, TestMiss, TestIdempotentSet
from hicache_storage.conformance.checks.sizes import TestValueSizes, TestKeyShapes
from hicache_storage.conformance.checks.batch import TestBatch, TestPrefix
from hicache_storage.conformance.checks.zerocopy import (
    TestZeroCopy,
    TestUnifiedObjects,
    TestModelPages,
    TestNativeZeroCopy,
    TestBufferSize,
)
from hicache_storage.conformance.checks.bad_input import TestBadInput
from hicache_storage.conformance.checks.lifecycle import TestLifecycle
from hicache_storage.conformance.checks.resources import TestResources
from hicache_storage.conformance.checks.close_race import TestCloseRace
from hicache_storage.conformance.checks.concurrency import TestFirstWins, TestConcurrency
from hicache_storage.conformance.checks.sharing import (
    TestMultiProcess,
    TestStaleViews,
    TestPersistence,
)
from hicache_storage.conformance.checks.capacity import TestBounded, TestDelete, TestClear
from hicache_storage.conformance.checks.stats import TestStats
from hicache_storage.conformance.checks.crash import TestCrashSafety
from hicache_storage.conformance.checks.faults import (
    server_control,
    TestFaults,
    TestMediumFaults,
    TestServerFaults,
)
from hicache_storage.conformance.checks.deadline import TestNothingAfterReturn
from hicache_storage.conformance.checks.endtoend import TestEndToEnd
from hicache_storage.conformance.checks.integrity import TestIntegrity, TestIdentityReuse
from hicache_storage.conformance.checks.formats import TestObjectFormats
from hicache_storage.conformance.checks.isolation import TestNamespaces, TestSecrets
from hicache_storage.conformance.checks.model import TestStateMachine
# isort: on

__all__ = [
    *_fixtures.__all__,
    "server_control",
    "TestRoundTrip",
    "TestMiss",
    "TestIdempotentSet",
    "TestValueSizes",
    "TestKeyShapes",
    "TestBatch",
    "TestPrefix",
    "TestZeroCopy",
    "TestUnifiedObjects",
    "TestModelPages",
    "TestNativeZeroCopy",
    "TestBufferSize",
    "TestBadInput",
    "TestLifecycle",
    "TestResources",
    "TestCloseRace",
    "TestFirstWins",
    "TestConcurrency",
    "TestMultiProcess",
    "TestStaleViews",
    "TestPersistence",
    "TestBounded",
    "TestDelete",
    "TestClear",
    "TestStats",
    "TestCrashSafety",
    "TestFaults",
    "TestMediumFaults",
    "TestServerFaults",
    "TestNothingAfterReturn",
    "TestEndToEnd",
    "TestIntegrity",
    "TestIdentityReuse",
    "TestObjectFormats",
    "TestNamespaces",
    "TestSecrets",
    "TestStateMachine",
]
