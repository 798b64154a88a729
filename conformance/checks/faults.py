"""Faults: injected load failures never give wrong bytes; a failing medium raises typed errors.

``TestMediumFaults`` makes the medium of any backend that holds a
:class:`hicache_storage.kit.MediumFaults` (as ``medium_faults``) raise its own exceptions, and
requires the typed errors of the contract from the bare backend and counted misses through the
default layers. ``TestServerFaults`` stops or pauses a backend's server through a plugin's
server control and requires misses within the deadline.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.config import FaultConfig, FaultRule
from hicache_storage.conformance.checks.common import (
    SENTINEL,
    SLACK_S,
    _bytes,
    _expected_after_load,
    _indices,
    _pool,
    _random_fill,
    _raw,
    _sentinel_fill,
)
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.conformance.server import find_server_control
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    UnsupportedOperationError,
)
from hicache_storage.kit import FAULT_KINDS, MediumFaults
from hicache_storage.kit.services import PausableServerControl, ServerControl
from hicache_storage.layers import ForwardingBackend

__all__ = ["server_control", "TestFaults", "TestMediumFaults", "TestServerFaults"]


class TestFaults:
    """With injected load failures, every key loads correctly or reports a miss; never bad bytes."""

    def test_v1_faults_never_wrong_bytes(
        self, hicache_factory: BackendFactory, k: Keyspace
    ) -> None:
        faults = FaultConfig(seed=1234, ops={"batch_get_v1": FaultRule(failure_rate=0.5)})
        layers = msgspec.structs.replace(hicache_factory.layers, faults=faults)
        with hicache_factory(layers) as instance:
            source = _pool("mha", "layer_first", pages=16)
            _random_fill(source, seed=99)
            keys = k.many("fault", 16)
            instance.register_host_pool(source)
            assert instance.batch_set_v1(keys, _indices(source, range(16))) == [True] * 16
            assert instance.batch_exists(keys) == 16
            target = _pool("mha", "layer_first", pages=16)
            _sentinel_fill(target)
            instance.register_host_pool(target)
            order = list(reversed(range(16)))
            hits = instance.batch_get_v1(keys, _indices(target, order))
            moves = [
                (src, dst) for src, dst, hit in zip(range(16), order, hits, strict=True) if hit
            ]
            assert torch.equal(_raw(target), _expected_after_load(target, source, moves, "mha"))
            cleanup(hicache_factory, instance, k)


def _server_timeout(control: ServerControl, options: dict[str, Any]) -> float:
    value = getattr(control, "timeout_s", None)
    if isinstance(value, (int, float)):
        return float(value)
    for name in ("deadline_s", "timeout_s", "op_timeout_s", "request_timeout_s", "timeout"):
        option = options.get(name)
        if isinstance(option, (int, float)) and not isinstance(option, bool):
            return float(option)
    return 5.0


@pytest.fixture
def server_control(hicache_factory: BackendFactory) -> Iterator[ServerControl]:
    """Yield the plugin-provided server control; skip when no plugin provides one."""
    control = find_server_control(hicache_factory.name, hicache_factory.options)
    if control is None:
        pytest.skip(
            f"no server control for backend {hicache_factory.name} "
            f"(provide the hicache_conformance_server hook)"
        )
    try:
        yield control
    finally:
        control.start()


def _calls_miss_in_time(
    control: ServerControl,
    factory: BackendFactory,
    k: Keyspace,
    fault: Callable[[], None],
    state: str,
) -> None:
    """Break the server with ``fault``; every call, single and batched, answers within the bound.

    Each answer is a miss or, where part of the store still answers (one node of a cluster
    paused), the correct value: never wrong bytes, never a write into the pool on a failed load.
    Batches span 32 keys so a client that retries key by key (or node by node) shows it.
    """
    layers = msgspec.structs.replace(factory.layers, degrade=True, faults=None)
    limit = _server_timeout(control, factory.options) + SLACK_S
    pool = _pool("mha", "layer_first", pages=40)
    many = k.many(f"{state}-many", 32)
    values = [b"%02d" % i for i in range(32)]
    with factory(layers) as instance:
        instance.register_host_pool(pool)
        assert instance.set(k("up"), b"before the outage")
        assert instance.batch_set(many, values) == [True] * 32
        fault()
        _sentinel_fill(pool)
        outs = [bytearray(2) for _ in many]
        into = bytearray(17)

        def batch_read() -> object:
            hits = instance.batch_get(many, outs)
            wrong = [i for i, hit in enumerate(hits) if hit and bytes(outs[i]) != values[i]]
            return f"wrong bytes for keys {wrong}" if wrong else len(hits) == 32

        def read() -> object:
            got = instance.get(k("up"))
            return got is None or _bytes(got) == b"before the outage"

        def read_into() -> object:
            got = instance.get(k("up"), into)
            return got is None or bytes(into) == b"before the outage"

        calls: dict[str, Callable[[], object]] = {
            "get": read,
            "get_into": read_into,
            "exists": lambda: isinstance(instance.exists(k("up")), bool),
            "set": lambda: isinstance(instance.set(k("down"), b"x"), bool),
            "batch_get": batch_read,
            "batch_set": lambda: (
                len(instance.batch_set([f"{key}-n" for key in many], [b"x"] * 32)) == 32
            ),
            "batch_exists": lambda: 0 <= instance.batch_exists(many) <= 32,
            # The stored values are not page-sized: every load is a miss, the pool untouched.
            "batch_get_v1": lambda: (
                instance.batch_get_v1(many, _indices(pool, range(32))) == [False] * 32
            ),
            "batch_set_v1": lambda: (
                len(
                    instance.batch_set_v1(
                        [f"{key}-v" for key in many],
                        _indices(pool, [32 + i % 8 for i in range(32)]),
                    )
                )
                == 32
            ),
        }
        for op, call in calls.items():
            start = time.monotonic()
            verdict = call()
            elapsed = time.monotonic() - start
            assert elapsed <= limit, (
                f"{op} took {elapsed:.2f}s with the server {state}; the bound is {limit:.2f}s "
                f"(the backend's deadline plus {SLACK_S:g}s): honour one overall per-call "
                f"deadline, including inside the client library's retries"
            )
            assert verdict is True, f"{op} with the server {state}: {verdict}"
        assert bool((_raw(pool) == SENTINEL).all()), f"a failed load wrote into the pool ({state})"


class TestServerFaults:
    """With the server down every call answers a miss in time; after a restart it works again."""

    def test_server_down_calls_miss_within_timeout(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        _calls_miss_in_time(server_control, hicache_factory, k, server_control.stop, "down")

    def test_server_paused_calls_miss_within_deadline(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        if not isinstance(server_control, PausableServerControl):
            pytest.skip("the server control has no pause()/resume()")
        try:
            _calls_miss_in_time(server_control, hicache_factory, k, server_control.pause, "paused")
        finally:
            server_control.resume()

    def test_server_restart_recovers(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        limit = _server_timeout(server_control, hicache_factory.options) + SLACK_S
        server_control.stop()
        backend.get(k("r"))
        server_control.start()
        deadline = time.monotonic() + 2 * limit
        while not backend.set(k("r"), b"after restart") and time.monotonic() < deadline:
            time.sleep(0.1)
        got = backend.get(k("r"))
        assert got is not None and _bytes(got) == b"after restart"


_EXPECTED: dict[str, type[BackendError]] = {
    "io": BackendError,  # BackendIOError, or any other BackendError subclass
    "unavailable": BackendUnavailableError,
    "timeout": BackendTimeoutError,
}
_READS = ("get", "get_into", "exists", "batch_get", "batch_exists", "batch_get_v1")
_WRITES = ("set", "batch_set", "batch_set_v1")
_NO_HOOK = "backend has no medium fault hook (hicache_storage.kit.MediumFaults)"


def _bare(backend: StorageBackend) -> StorageBackend:
    return backend.unwrap() if isinstance(backend, ForwardingBackend) else backend


def _medium_faults(bare: StorageBackend) -> MediumFaults:
    faults = getattr(bare, "medium_faults", None)
    if not isinstance(faults, MediumFaults):
        pytest.skip(_NO_HOOK)
    return faults


class _Medium:
    """The objects one fault check works on, and the calls it makes (each on one key)."""

    def __init__(self, target: StorageBackend, k: Keyspace, tag: str) -> None:
        self.target = target
        self.key = k(f"{tag}-stored")
        self.value = b"medium fault check value " * 40
        self.pool = _pool("mla", "page_first", pages=4)
        _random_fill(self.pool, seed=11)
        target.register_host_pool(self.pool)
        self.page_key = k(f"{tag}-page")
        self.page = _bytes(self.pool.get_data_page(0))
        self.k = k
        self.tag = tag

    def prepare(self) -> None:
        """(Re)store the key and the page every read path reads, with faults disarmed."""
        assert self.target.set(self.key, self.value), f"set({self.key!r}) failed with no fault"
        assert self.target.batch_set_v1([self.page_key], _indices(self.pool, [0])) == [True]

    def new_key(self, op: str) -> str:
        return self.k(f"{self.tag}-{op}-new")

    def call(self, op: str) -> tuple[object, str, bytes | None]:
        """Make ``op``; return its result, the key it wrote (if any) and the value written."""
        b, key, value = self.target, self.key, self.value
        if op == "get":
            got = b.get(key)
            return (None if got is None else _bytes(got)), "", None
        if op == "get_into":
            out = bytearray(len(value))
            return (None if b.get(key, out) is None else bytes(out)), "", None
        if op == "exists":
            return b.exists(key), "", None
        if op == "batch_get":
            outs = [bytearray(len(value))]
            hits = b.batch_get([key], outs)
            return (bytes(outs[0]) if hits == [True] else hits), "", None
        if op == "batch_exists":
            return b.batch_exists([key]), "", None
        if op == "batch_get_v1":
            return b.batch_get_v1([self.page_key], _indices(self.pool, [1])), "", None
        if op == "delete":
            return b.delete(key), "", None
        if op == "clear":
            b.clear()
            return None, "", None
        new = self.new_key(op)
        if op == "set":
            return b.set(new, value), new, value
        if op == "batch_set":
            return b.batch_set([new], [value]), new, value
        return b.batch_set_v1([new], _indices(self.pool, [0])), new, self.page

    def correct(self, op: str, result: object) -> bool:
        """Whether ``result`` is the right answer of read ``op`` with nothing failing."""
        expected: dict[str, object] = {
            "get": self.value,
            "get_into": self.value,
            "exists": True,
            "batch_get": self.value,
            "batch_exists": 1,
            "batch_get_v1": [True],
        }
        return result == expected[op]

    @staticmethod
    def miss(op: str, result: object) -> bool:
        misses: dict[str, object] = {
            "get": None,
            "get_into": None,
            "exists": False,
            "batch_get": [False],
            "batch_exists": 0,
            "batch_get_v1": [False],
        }
        return result == misses[op]

    def stored(self, key: str, value: bytes) -> bool | None:
        """Return True if ``key`` holds ``value``, False if absent, None if it holds other bytes."""
        got = self.target.get(key)
        if got is None:
            return False
        return True if _bytes(got) == value else None


def _spy(faults: MediumFaults, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the medium operations whose check raised (the ones that failed)."""
    fired: list[str] = []
    check = faults.check

    def spy(op: str) -> None:
        try:
            check(op)
        except BaseException:
            fired.append(op)
            raise

    monkeypatch.setattr(faults, "check", spy)
    return fired


def _ops(caps: object) -> list[str]:
    ops = [*_READS, *_WRITES]
    if getattr(caps, "delete", False):
        ops.append("delete")
    return [*ops, "clear"]


class TestMediumFaults:
    """A failing medium gives typed errors from the bare backend and counted misses in layers."""

    @pytest.mark.parametrize("kind", FAULT_KINDS)
    def test_medium_fault_bare_backend_raises_typed_error(
        self, backend: StorageBackend, k: Keyspace, kind: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every call whose medium operation fails raises the kind's typed error.

        ``io`` a ``BackendError`` (``BackendIOError``), ``unavailable``
        ``BackendUnavailableError``, ``timeout`` ``BackendTimeoutError``: never the medium's own
        exception, never an answer made up after a failure. ``vanished`` (the object went away
        while being read) is a miss on the read paths, and no raw error anywhere. A write that
        reports success must have stored its value; one that did not leaves the key absent.
        """
        bare = _bare(backend)
        faults = _medium_faults(bare)
        if kind not in faults.kinds:
            pytest.skip(f"this medium raises no {kind!r} faults (its kinds: {faults.kinds})")
        fired = _spy(faults, monkeypatch)
        medium = _Medium(bare, k, f"bare-{kind}")
        problems: list[str] = []
        for op in _ops(bare.capabilities):
            medium.prepare()
            fired.clear()
            error: BaseException | None = None
            result: object = None
            written, value = "", None
            with faults.armed(kind):
                try:
                    result, written, value = medium.call(op)
                except UnsupportedOperationError:
                    continue
                except BaseException as exc:  # noqa: BLE001 - judged below
                    error = exc
            problems += _judge(op, kind, fired, result, error, medium)
            if written and value is not None:
                ok = result is True or result == [True]
                held = medium.stored(written, value)
                if ok and held is not True:
                    problems.append(
                        f"{op}({written!r}) with the medium failing ({kind}) reported success "
                        f"but get then returned {'None' if held is False else 'other bytes'}: "
                        f"report True only for values stored"
                    )
                elif not ok and held is None:
                    problems.append(
                        f"{op}({written!r}) failed ({kind}) and left other bytes under the key"
                    )
        assert bare.set(medium.new_key("after"), b"recovered"), "set failed after disarming"
        assert not problems, f"{len(problems)} wrong answers to medium faults; " + "; ".join(
            problems[:6]
        )

    @pytest.mark.parametrize("kind", [kind for kind in FAULT_KINDS if kind != "vanished"])
    def test_medium_fault_through_layers_is_counted_miss(
        self,
        hicache_factory: BackendFactory,
        k: Keyspace,
        kind: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Through the default layers, every call the failing medium breaks is a counted miss.

        Without the health layer, which after one timeout answers every call itself until its
        probe succeeds (``tests/test_health.py``): each call here must reach the medium.
        """
        layers = msgspec.structs.replace(hicache_factory.layers, health=None)
        with hicache_factory(layers) as backend:
            try:
                self._counted_misses(backend, k, kind, monkeypatch)
            finally:
                cleanup(hicache_factory, backend, k)

    @staticmethod
    def _counted_misses(
        backend: StorageBackend, k: Keyspace, kind: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        faults = _medium_faults(_bare(backend))
        if kind not in faults.kinds:
            pytest.skip(f"this medium raises no {kind!r} faults (its kinds: {faults.kinds})")
        fired = _spy(faults, monkeypatch)
        medium = _Medium(backend, k, f"layers-{kind}")
        problems: list[str] = []
        for op in _ops(backend.capabilities):
            medium.prepare()
            fired.clear()
            before = backend.stats().get("degraded", {}).get("total", 0)
            with faults.armed(kind):
                try:
                    result, written, _ = medium.call(op)
                except BaseException as exc:  # noqa: BLE001 - reported
                    problems.append(f"{op} through the layers raised {type(exc).__name__}: {exc}")
                    continue
            if not fired:
                continue
            counted = backend.stats().get("degraded", {}).get("total", 0) - before
            if op in _READS and not medium.miss(op, result):
                problems.append(f"{op} through the layers answered {result!r}, not a miss")
            if op in _WRITES and result not in (False, [False]):
                problems.append(f"{op}({written!r}) through the layers answered {result!r}")
            if counted < 1:
                problems.append(
                    f"{op} failed on the medium ({kind}) but the degrade layer counted no error "
                    f"(the backend must raise a BackendError, not answer a miss itself)"
                )
        assert not problems, f"{len(problems)} medium faults not counted as misses; " + "; ".join(
            problems[:6]
        )

    def test_medium_write_fault_in_batch_reports_false_for_unstored(
        self, backend: StorageBackend, k: Keyspace, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The first write of a ``batch_set`` fails: keys reported True are readable.

        The bare backend either raises a ``BackendError`` or reports per key; a key it reports
        True for must hold its value afterwards, and no key holds part of a value.
        """
        bare = _bare(backend)
        faults = _medium_faults(bare)
        if "io" not in faults.kinds:
            pytest.skip("this medium raises no 'io' faults")
        keys = k.many("wb", 3)
        values = [b"%d batch value " % i * 30 for i in range(3)]
        faults.arm("io", ops={"write"}, times=1)
        try:
            results = bare.batch_set(keys, values)
        except BackendError:
            results = [False] * 3
        finally:
            faults.disarm()
        problems = []
        for key, value, ok in zip(keys, values, results, strict=True):
            got = bare.get(key)
            if ok and (got is None or _bytes(got) != value):
                problems.append(
                    f"batch_set reported True for {key!r} though a write failed (io): get then "
                    f"returned {'None' if got is None else 'other bytes'}; report True only for "
                    f"values stored"
                )
            elif got is not None and _bytes(got) != value:
                problems.append(f"after a failed batch_set, {key!r} holds other bytes")
        assert not problems, "; ".join(problems)


def _judge(
    op: str,
    kind: str,
    fired: list[str],
    result: object,
    error: BaseException | None,
    medium: _Medium,
) -> list[str]:
    """Return what is wrong with the answer of ``op`` while the medium raised ``kind``."""
    if not fired:  # answered without the medium (a cache, an index): must be right
        if error is not None:
            return [f"{op} raised {type(error).__name__}: {error} with no medium operation failing"]
        if op in _READS and not medium.correct(op, result):
            return [f"{op} answered {result!r} without touching the failing medium"]
        return []
    where = f"{op} with the medium's {'/'.join(sorted(set(fired)))} failing ({kind})"
    if kind == "vanished":
        if error is not None and not isinstance(error, BackendError):
            return [f"{where} leaked {type(error).__name__}: {error}; translate it"]
        if op in _READS or op == "delete":
            if error is not None:
                return [
                    f"{where} raised {type(error).__name__}: {error}; an object that vanished "
                    f"while being read is a miss, not an error"
                ]
            if op in _READS and not medium.miss(op, result):
                return [f"{where} answered {result!r}; expected a miss"]
        return []
    expected = _EXPECTED[kind]
    if error is None:
        return [
            f"{where} answered {result!r}; a failing medium must raise {expected.__name__}, "
            f"never answer a miss or success"
        ]
    if not isinstance(error, expected):
        return [
            f"{where} raised {type(error).__name__}: {error}; expected {expected.__name__} "
            f"(map the medium's exception in one place, e.g. hicache_storage.kit.ErrorMap)"
        ]
    return []
