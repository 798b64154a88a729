"""Nothing after return: a call that answered never touches its buffers or publishes afterwards.

An engine reuses a host page's slots, and a bytearray it passed, the moment the call that used
them returns, whatever it answered (a result, a miss, an error). A backend that gives up on a
call at its deadline but leaves the work running (a thread of its own, a client library's I/O
thread, a storage process) writes a stored page into slots that now hold other KV, or stores a
page read from slots since refilled under a key whose first writer wins: wrong KV now, or a
wrong hit for every engine sharing the store later. These checks pause the server past the
deadline during reads and during writes, reuse every buffer once the call has returned, resume
the server, give a late action time to land, and require the buffers and the store to show none.
"""

# ruff: noqa: D102 - each check is named test_<what>_<condition>; the name is its doc
from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.config import LayerConfig
from hicache_storage.conformance.checks.common import SLACK_S, _bytes, _indices, _pool, _raw
from hicache_storage.conformance.checks.faults import _server_timeout
from hicache_storage.conformance.factory import BackendFactory
from hicache_storage.conformance.fixtures import Keyspace, cleanup
from hicache_storage.errors import HiCacheError
from hicache_storage.kit.services import PausableServerControl, ServerControl

__all__ = ["TestNothingAfterReturn"]

SETTLE_S = 1.0
"""How long after the resumed server answers again the check waits for a late action to land:
a late action runs as soon as its reply arrives, which precedes the answer the check waits for
on a server that serves in order, so this only covers the backend's own scheduling."""

PAGES = 8


def _pausable(control: ServerControl) -> PausableServerControl:
    if not isinstance(control, PausableServerControl):
        pytest.skip("the server control has no pause()/resume()")
    return control


def _timed(limit: float, what: str, call: Callable[[], object]) -> object:
    """Make ``call``; a typed error counts as its answer. Fail if it outlives ``limit``."""
    began = time.monotonic()
    try:
        answer = call()
    except HiCacheError as exc:
        answer = exc
    elapsed = time.monotonic() - began
    assert elapsed <= limit, (
        f"{what} took {elapsed:.2f}s with the server paused; the bound is {limit:.2f}s"
    )
    return answer


def _settle(
    control: PausableServerControl, instance: StorageBackend, k: Keyspace, limit: float
) -> None:
    """Resume the server, wait until the backend answers through it again, then a little more."""
    control.resume()
    deadline = time.monotonic() + 3 * limit
    while time.monotonic() < deadline:
        try:
            if instance.set(k("settle"), b"up") and instance.exists(k("settle")):
                break
        except HiCacheError:
            pass
        time.sleep(0.1)
    time.sleep(SETTLE_S)


def _layers(factory: BackendFactory) -> LayerConfig:
    """Return the default stack without the health layer, so every call reaches the backend.

    After a first timeout the health layer answers for a paused server itself.
    """
    return msgspec.structs.replace(factory.layers, degrade=True, health=None, faults=None)


def _random(shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


class TestNothingAfterReturn:
    """Past its deadline a call gives up for good: no late write into buffers, no late publish."""

    def test_read_past_deadline_never_writes_buffers_after_return(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        control = _pausable(server_control)
        limit = _server_timeout(control, hicache_factory.options) + SLACK_S
        layers = _layers(hicache_factory)
        pool = _pool("mha", "layer_first", pages=2 * PAGES)
        raw = _raw(pool)
        raw.copy_(_random(raw.shape, seed=7))
        keys = k.many("late-read", PAGES)
        values = [bytes(_random((4096,), seed=100 + i).numpy()) for i in range(PAGES)]
        singles = k.many("late-read-b", PAGES)
        with hicache_factory(layers) as instance:
            try:
                instance.register_host_pool(pool)
                assert instance.batch_set_v1(keys, _indices(pool, range(PAGES))) == [True] * PAGES
                assert instance.batch_set(singles, values) == [True] * PAGES
                control.pause()
                try:
                    targets = list(range(PAGES, 2 * PAGES))
                    _timed(
                        limit,
                        "batch_get_v1",
                        lambda: instance.batch_get_v1(keys, _indices(pool, targets)),
                    )
                    outs = [bytearray(4096) for _ in singles]
                    _timed(limit, "batch_get", lambda: instance.batch_get(singles, outs))
                    into = bytearray(4096)
                    _timed(limit, "get", lambda: instance.get(singles[0], into))
                    # The call has returned: the engine reuses every buffer it passed.
                    reused = _random(raw.shape, seed=8)
                    raw.copy_(reused)
                    for i, out in enumerate(outs):
                        out[:] = bytes([i]) * len(out)
                    into[:] = b"\x5a" * len(into)
                finally:
                    _settle(control, instance, k, limit)
                problems = []
                if not torch.equal(raw, reused):
                    changed = int((raw != reused).sum())
                    problems.append(
                        f"batch_get_v1 wrote {changed} bytes into the host pool after it returned"
                    )
                late = [i for i, out in enumerate(outs) if bytes(out) != bytes([i]) * len(out)]
                if late:
                    problems.append(f"batch_get wrote buffers {late} after it returned")
                if bytes(into) != b"\x5a" * len(into):
                    problems.append("get(key, out) wrote out after it returned")
                assert not problems, (
                    "; ".join(problems) + ": once a call has returned (a result, a miss, an "
                    "error), nothing may write the caller's buffers for it; cancel the work "
                    "under a lock, or read into a private buffer"
                )
            finally:
                cleanup(hicache_factory, instance, k)

    def test_write_past_deadline_never_publishes_reused_buffers(
        self,
        server_control: ServerControl,
        hicache_factory: BackendFactory,
        backend: StorageBackend,
        k: Keyspace,
    ) -> None:
        control = _pausable(server_control)
        limit = _server_timeout(control, hicache_factory.options) + SLACK_S
        layers = _layers(hicache_factory)
        pool = _pool("mha", "layer_first", pages=PAGES)
        raw = _raw(pool)
        raw.copy_(_random(raw.shape, seed=17))
        written = [_bytes(pool.get_data_page(page * pool.page_size)) for page in range(PAGES)]
        keys = k.many("late-write", PAGES)
        singles = k.many("late-write-b", PAGES)
        values = [bytearray(_random((4096,), seed=200 + i).numpy().tobytes()) for i in range(PAGES)]
        originals = [bytes(value) for value in values]
        one = k("late-write-single")
        single = bytearray(b"\x11" * 4096)
        with hicache_factory(layers) as instance:
            try:
                instance.register_host_pool(pool)
                control.pause()
                try:
                    _timed(
                        limit,
                        "batch_set_v1",
                        lambda: instance.batch_set_v1(keys, _indices(pool, range(PAGES))),
                    )
                    _timed(limit, "batch_set", lambda: instance.batch_set(singles, values))
                    _timed(limit, "set", lambda: instance.set(one, single))
                    # The calls have returned: the engine refills the slots and the buffers.
                    raw.copy_(_random(raw.shape, seed=18))
                    for value in values:
                        value[:] = b"\xee" * len(value)
                    single[:] = b"\xee" * len(single)
                finally:
                    _settle(control, instance, k, limit)
                expected: list[tuple[str, bytes]] = [
                    *zip(keys, written, strict=True),
                    *zip(singles, originals, strict=True),
                    (one, b"\x11" * 4096),
                ]
                wrong = []
                for key, original in expected:
                    got = instance.get(key)
                    if got is not None and _bytes(got) != original:
                        wrong.append(key)
                assert not wrong, (
                    f"{len(wrong)} keys hold bytes the caller put in its buffers after the write "
                    f"returned ({wrong[:3]}): a write given up at its deadline must never "
                    f"publish, and must not read the caller's buffers once it has returned"
                )
            finally:
                cleanup(hicache_factory, instance, k)
