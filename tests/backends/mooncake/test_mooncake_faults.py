"""Deadlines against real processes: the master or the segment holder SIGSTOPped by PID.

Every call returns within ``deadline_s`` (plus a little slack) as a miss through the default
layers, no failed load writes into the host pool, and after SIGCONT the backend works again.
These run on a store of their own, so pausing it never stalls the session's store.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from hicache_storage import create_backend
from hicache_storage.backend import StorageBackend
from hicache_storage.backends.mooncake import provision
from hicache_storage.backends.mooncake.client import Timeouts
from hicache_storage.config import LayerConfig
from hicache_storage.errors import BackendUnavailableError
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kit.services import LocalService, freeze

from ...helpers import page_indices, pool_bytes

SLACK_S = 1.0
"""What a call may take past its deadline (scheduling on a shared 2-core machine)."""

SENTINEL = 0x5A


class Store:
    """A master and a segment holder, with the PIDs to SIGSTOP."""

    def __init__(self, master: LocalService, holder: LocalService) -> None:
        self.master = master
        self.holder = holder

    @property
    def address(self) -> str:
        return str(self.master.options["master"])

    def signal(self, service: LocalService, signum: int) -> None:
        """Send ``signum``; a SIGSTOP returns only once every thread has stopped."""
        pid = service.state.processes[0].pid
        assert pid is not None
        if signum == signal.SIGSTOP:
            freeze(pid)
        else:
            os.kill(pid, signum)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with provision.local_services(tmp_path_factory.mktemp("mooncake-faults")) as services:
        yield Store(*services)


def _pool() -> MHAHostPool:
    return MHAHostPool(
        48, 8, 2, 2, 64, dtype=torch.bfloat16, layout="layer_first", pin_memory=False
    )


def _timed(calls: dict[str, tuple[Callable[[], object], object]]) -> dict[str, float]:
    """Run each call; assert it answered its miss; return the seconds each took."""
    took = {}
    for op, (call, miss) in calls.items():
        start = time.monotonic()
        result = call()
        took[op] = time.monotonic() - start
        assert result == miss, f"{op} returned {result!r}"
    return took


def _recovers(backend: StorageBackend, key: str, limit: float) -> float:
    """Return how long until a put and a get work again (fail past ``limit`` seconds)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if backend.set(key, b"after") and backend.get(key) == b"after":
            return time.monotonic() - start
        time.sleep(0.1)
    pytest.fail(f"the backend did not recover within {limit:g}s")


@pytest.mark.parametrize("deadline", [2.0, 5.0])
def test_paused_master_calls_miss_within_deadline(store: Store, deadline: float) -> None:
    """SIGSTOP the master: every call misses in time, the pool stays untouched, SIGCONT heals.

    Before the deadline option, each of these calls waited the client's 30 s RPC timeout.
    """
    pool = _pool()
    options = {"master": store.address, "deadline_s": deadline, "prefix": secrets.token_hex(4)}
    keys = [f"k{i}" for i in range(32)]
    with create_backend("mooncake", options) as backend:
        backend.register_host_pool(pool)
        pool_bytes(pool).copy_(torch.randint(0, 256, pool_bytes(pool).shape, dtype=torch.uint8))
        assert backend.batch_set(keys, [b"%d" % i for i in range(32)]) == [True] * 32
        assert backend.batch_set_v1(keys[:6], page_indices(pool, list(range(6)))) == [True] * 6
        store.signal(store.master, signal.SIGSTOP)
        try:
            pool_bytes(pool).fill_(SENTINEL)
            outs = [bytearray(2) for _ in keys]
            took = _timed(
                {
                    "get": (lambda: backend.get("k1"), None),
                    "batch_get_v1": (
                        lambda: backend.batch_get_v1(keys[:6], page_indices(pool, list(range(6)))),
                        [False] * 6,
                    ),
                    "exists": (lambda: backend.exists("k1"), False),
                    "get_into": (lambda: backend.get("k1", bytearray(1)), None),
                    "set": (lambda: backend.set("new", b"x"), False),
                    "batch_get": (lambda: backend.batch_get(keys, outs), [False] * 32),
                    "batch_set": (
                        lambda: backend.batch_set([f"n{k}" for k in keys], [b"x"] * 32),
                        [False] * 32,
                    ),
                    "batch_exists": (lambda: backend.batch_exists(keys), 0),
                    "batch_set_v1": (
                        lambda: backend.batch_set_v1(["v0", "v1"], page_indices(pool, [4, 5])),
                        [False] * 2,
                    ),
                    "delete": (lambda: backend.delete("k2"), False),
                }
            )
            assert bool((pool_bytes(pool) == SENTINEL).all()), "a failed load wrote into the pool"
            assert all(out == bytearray(2) for out in outs)
        finally:
            store.signal(store.master, signal.SIGCONT)
        time.sleep(0.5)  # a late write from a given-up load would land now
        assert bool((pool_bytes(pool) == SENTINEL).all()), "a failed load wrote into the pool later"
        print(f"deadline {deadline:g}s, master paused:", {k: round(v, 2) for k, v in took.items()})
        assert max(took.values()) <= deadline + SLACK_S, took
        # The first call waited out the library's own RPC timeout; the breaker then failed the
        # others at once.
        assert took["get"] <= Timeouts.split(deadline).rpc_s + SLACK_S, took
        errors = backend.stats()["errors"]
        assert errors.get("RPC_TIMEOUT", 0) >= 1 and errors.get("master_unreachable", 0) >= 1
        _recovers(backend, "after", 2 * deadline)
        assert backend.get("k3") == b"3"  # the data outlived the pause


def test_first_call_after_a_master_restart_succeeds(store: Store) -> None:
    """A put right after the master is back is stored (the suite's next check does one).

    The master is ready once the holder's segment is mounted again; a call made while the port
    was closed opened the breaker, and the first call after the restart asks the master. The
    first request after a restart can meet the connection the old master closed (seen in the
    suite as ``RPC_FAIL``, which the library does not retry): the backend sends it once more.
    """
    options = {"master": store.address, "prefix": secrets.token_hex(4)}
    with create_backend("mooncake", options) as backend:
        assert backend.set("before", b"1")
        store.master.stop()
        assert backend.get("before") is None  # down: a miss, and the breaker opens
        store.master.start()  # ready once the holder's segment is mounted again
        assert backend.set("first", b"2"), backend.stats()["errors"]
        assert backend.get("first") == b"2"
        assert backend.batch_exists(["first"]) == 1


def test_backend_built_while_master_paused_fails_in_time(store: Store) -> None:
    options = {"master": store.address, "deadline_s": 3.0}
    store.signal(store.master, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(BackendUnavailableError, match="setup"):
            create_backend("mooncake", options)
        took = time.monotonic() - start
    finally:
        store.signal(store.master, signal.SIGCONT)
    assert took <= 3.0 + SLACK_S, f"setup against a paused master took {took:.2f}s"
    with create_backend("mooncake", options) as backend:  # and once it answers, it works
        assert backend.set("built", b"ok") and backend.get("built") == b"ok"
        backend.delete("built")


def test_paused_holder_loads_miss_within_the_transfer_bound(store: Store) -> None:
    """SIGSTOP the segment holder: every call returns in time, and never with wrong bytes.

    A transfer to a silent peer fails after ``transfer_s`` without progress; the library runs
    four per peer at a time and does not abandon the queued ones, so a request waits about
    ``2 * transfer_s`` per four buffers (docs/backends/mooncake.md, "Failure behaviour").
    On one host the library may also reach the holder's segment without the holder's help
    (seen once in a loaded CI run: a hit while the holder was stopped), so a hit is accepted
    when its bytes are the stored ones; a miss must leave its page untouched.
    """
    deadline = 2.0
    transfer_s = Timeouts.split(deadline).transfer_s
    pool = MHAHostPool(
        48, 8, 2, 2, 64, dtype=torch.bfloat16, layout="page_first", pin_memory=False
    )  # two buffers per page
    options = {"master": store.address, "deadline_s": deadline, "prefix": secrets.token_hex(4)}
    keys = ["h0", "h1"]
    value = secrets.token_bytes(5000)
    # The backend's own bound: the verify layer would read each page's record too, one more
    # buffer per page from the same holder (docs/reliability.md, footnote 3).
    layers = LayerConfig(verify=False)
    with create_backend("mooncake", options, layers=layers) as backend:
        backend.register_host_pool(pool)
        pool_bytes(pool).copy_(torch.randint(0, 256, pool_bytes(pool).shape, dtype=torch.uint8))
        stored = [page.clone() for page in _pages(pool, [0, 1])]
        assert backend.batch_set_v1(keys, page_indices(pool, [0, 1])) == [True] * 2
        assert backend.set("value", value)
        store.signal(store.holder, signal.SIGSTOP)
        try:
            pool_bytes(pool).fill_(SENTINEL)
            out = bytearray(5000)
            took: dict[str, float] = {}
            start = time.monotonic()
            hits = backend.batch_get_v1(keys, page_indices(pool, [0, 1]))
            took["batch_get_v1"] = time.monotonic() - start
            start = time.monotonic()
            got = backend.get("value", out)
            took["get_into"] = time.monotonic() - start
            start = time.monotonic()
            written = backend.batch_set_v1(["w0"], page_indices(pool, [5]))
            took["batch_set_v1"] = time.monotonic() - start
            _check_loads(pool, hits, stored, "while paused")
            assert out == (value if got is not None else bytearray(5000)), "get_into: wrong bytes"
        finally:
            store.signal(store.holder, signal.SIGCONT)
        time.sleep(0.5)  # a late write from a given-up transfer would land now
        _check_loads(pool, hits, stored, "after SIGCONT")
        print(f"deadline {deadline:g}s, holder paused:", {k: round(v, 2) for k, v in took.items()})
        print("hits while paused:", hits, got is not None, written)
        assert max(took.values()) <= 2 * transfer_s + SLACK_S, took  # at most 4 buffers each
        if not all(hits) or got is None:
            assert backend.stats()["errors"].get("TRANSFER_FAIL", 0) >= 1
        _recovers(backend, "after", 5 * deadline)
        assert backend.batch_get_v1(keys, page_indices(pool, [0, 1])) == [True] * 2
        _check_loads(pool, [True, True], stored, "after the pause")


def _pages(pool: MHAHostPool, pages: list[int]) -> list[torch.Tensor]:
    """Return each page's bytes, in object order, as one tensor per page."""
    return [
        torch.cat([torch.frombuffer(view, dtype=torch.uint8) for view in views])
        for views in pool.page_buffer_views(page_indices(pool, pages))
    ]


def _check_loads(
    pool: MHAHostPool, hits: list[bool], stored: list[torch.Tensor], when: str
) -> None:
    """A hit's page holds the stored bytes; a miss's page is untouched (all SENTINEL)."""
    for page, (hit, expected) in enumerate(zip(hits, stored, strict=True)):
        got = _pages(pool, [page])[0]
        if hit:
            assert torch.equal(got, expected), f"page {page}: a hit with wrong bytes ({when})"
        else:
            assert bool((got == SENTINEL).all()), f"page {page}: a failed load wrote ({when})"
