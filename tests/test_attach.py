"""A store unreachable at start: a detached backend (misses, counted) that attaches once it answers.

The unit tests drive :class:`AttachingBackend` with a build that fails until told otherwise; the
rest go through :func:`open_backend` and :func:`create_backend` against a real Redis that is
stopped at start and started later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import (
    BackendUnavailableError,
    ConfigError,
    InvalidKeyError,
    StorageBackend,
    apply_layers,
    create_backend,
    open_backend,
)
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.backends.redis import provision
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import HealthConfig
from hicache_storage.integrations.vllm.config import tier_settings
from hicache_storage.kit.services import LocalService
from hicache_storage.layers import AttachingBackend

from .helpers import make_pool, page_indices, pool_bytes

FAST = HealthConfig(probe_interval_s=0.05, max_probe_interval_s=0.2)
QUICK_S = 0.5
"""A detached call answers at once: nothing is waited for."""
ATTACH_BOUND_S = 30.0
"""How long a started server may take to be attached (a start, then a probe's backoff)."""


def wait_until(condition: Callable[[], bool], bound_s: float = ATTACH_BOUND_S) -> bool:
    until = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.02)
    return True


class Build:
    """Builds a memory store, failing as an unreachable server does until ``up`` is set."""

    def __init__(self, error: Exception | None = None) -> None:
        self.up = threading.Event()
        self.error = error or BackendUnavailableError("connection refused")
        self.attempts = 0
        self.built: list[StorageBackend] = []

    def __call__(self) -> StorageBackend:
        self.attempts += 1
        if not self.up.is_set():
            raise self.error
        backend = apply_layers(MemoryBackend())
        self.built.append(backend)
        return backend


def attaching(build: Build) -> AttachingBackend:
    return AttachingBackend(
        build,
        name="memory",
        capabilities=Capabilities(delete=True),
        error=BackendUnavailableError("connection refused"),
        backoff=FAST,
    )


def test_detached_calls_are_counted_misses_and_the_store_attaches_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    build = Build()
    with caplog.at_level(logging.WARNING):
        backend = attaching(build)
    try:
        assert any(
            r.levelno == logging.ERROR and "cannot be reached at start" in r.getMessage()
            for r in caplog.records
        )
        pool = make_pool("mha", "layer_first", pages=4)
        backend.register_host_pool(pool)
        pool_bytes(pool).fill_(7)
        start = time.monotonic()
        assert backend.get("k") is None and not backend.exists("k")
        assert backend.set("k", b"v") is False
        assert backend.batch_exists(["k", "j"]) == 0
        assert backend.batch_set_v1(["a"], page_indices(pool, [0])) == [False]
        assert backend.batch_get_v1(["a"], page_indices(pool, [1])) == [False]
        assert time.monotonic() - start < QUICK_S
        assert bool((pool_bytes(pool) == 7).all()), "a detached load touched the pool"
        with pytest.raises(InvalidKeyError):  # caller mistakes still raise
            backend.get("../etc/passwd")
        stats = backend.stats()["attach"]
        assert stats["attached"] is False and stats["shed_total"] == 6
        assert stats["shed"]["batch_get_v1"] == 1 and "connection refused" in stats["last_error"]
        assert backend.capabilities == Capabilities(delete=True)

        build.up.set()
        assert wait_until(lambda: backend.attached, 5.0)
        # the host pool registered while detached reached the store: v1 calls work
        assert backend.batch_set_v1(["a"], page_indices(pool, [0])) == [True]
        assert backend.batch_get_v1(["a"], page_indices(pool, [1])) == [True]
        assert backend.set("k", b"v") and backend.get("k") == b"v"
        assert backend.capabilities == MemoryBackend.capabilities
        stats = backend.stats()
        assert stats["attach"]["attached"] is True and stats["attach"]["shed_total"] == 6
        assert "metrics" in stats  # the attached stack's own sections
        assert len(build.built) == 1
    finally:
        backend.close()
    assert backend.closed and build.built[0].closed


def test_a_config_error_on_a_later_attempt_ends_the_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    build = Build()
    with caplog.at_level(logging.ERROR):
        backend = attaching(build)
        try:
            build.error = ConfigError("the server refused the login")
            assert wait_until(lambda: "cannot be attached" in caplog.text, 5.0)
            attempts = build.attempts
            build.up.set()
            time.sleep(4 * FAST.max_probe_interval_s)
            assert build.attempts == attempts and not backend.attached
            assert backend.get("k") is None
            assert "refused the login" in backend.stats()["attach"]["last_error"]
        finally:
            backend.close()


def test_close_stops_the_attempts() -> None:
    build = Build()
    backend = attaching(build)
    thread = next(t for t in threading.enumerate() if t.name == "hicache-attach-memory")
    closer = threading.Thread(target=backend.close)
    closer.start()
    closer.join(5.0)
    assert not closer.is_alive() and not thread.is_alive()
    attempts = build.attempts
    build.up.set()
    time.sleep(4 * FAST.max_probe_interval_s)
    assert build.attempts == attempts and not build.built


# -- through the factory, against a real Redis stopped at start ---------------------------------


@pytest.fixture
def stopped_redis(tmp_path: Path) -> Iterator[LocalService]:
    """A Redis service described but not started; stopped by PID afterwards."""
    service = provision.standalone(tmp_path / "redis", deadline_s=1.0, socket_timeout_s=0.5)
    try:
        yield service
    finally:
        service.stop()


def redis_config(service: LocalService, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "redis",
        "options": {**service.options, "prefix": "attach"},
        "layers": {"health": {"probe_interval_s": 0.05, "max_probe_interval_s": 0.2}},
        **extra,
    }


def test_open_backend_starts_without_an_unreachable_store_and_attaches_it(
    stopped_redis: LocalService,
) -> None:
    backend = open_backend(redis_config(stopped_redis))
    try:
        assert isinstance(backend, AttachingBackend) and not backend.attached
        start = time.monotonic()
        assert backend.set("k", b"v") is False and backend.get("k") is None
        assert time.monotonic() - start < QUICK_S
        stopped_redis.start()
        assert wait_until(lambda: backend.attached), backend.stats()["attach"]
        assert backend.set("k", b"v") and backend.get("k") == b"v"
        assert backend.stats()["attach"]["shed"] == {"get": 1, "set": 1}
    finally:
        backend.clear()
        backend.close()


def test_strict_start_and_create_backend_refuse_an_unreachable_store(
    stopped_redis: LocalService,
) -> None:
    with pytest.raises(BackendUnavailableError, match="cannot reach"):
        open_backend(redis_config(stopped_redis, strict_start=True))
    config = redis_config(stopped_redis)
    with pytest.raises(BackendUnavailableError):
        create_backend("redis", config["options"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"options": {"url": "redis://127.0.0.1:1/0", "nope": 1}}, "nope"),
        ({"layers": {"stack": ["degrade", "tests.no_such_module:Layer"]}}, "could not be loaded"),
        ({"backend": "no-such-backend"}, "no-such-backend"),
    ],
)
def test_a_bad_config_still_fails_start_up(
    stopped_redis: LocalService, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        open_backend({**redis_config(stopped_redis), **change})


def test_the_vllm_tiers_settings_start_it_detached_or_strict(stopped_redis: LocalService) -> None:
    # What HiCacheTier.__init__ does with its entry (vLLM itself is not in this environment).
    entry = redis_config(stopped_redis)
    settings = tier_settings(entry)
    assert settings.hicache.strict_start is False
    backend = open_backend(settings.hicache)
    try:
        pool = make_pool("mla", "page_first", pages=4)
        backend.register_host_pool(pool)
        assert backend.batch_get_v1(["c0"], page_indices(pool, [0])) == [False]
        stopped_redis.start()
        assert wait_until(lambda: backend.stats()["attach"]["attached"])
        assert backend.batch_set_v1(["c0"], page_indices(pool, [0])) == [True]
        assert backend.batch_get_v1(["c0"], page_indices(pool, [1])) == [True]
    finally:
        backend.clear()
        backend.close()
    stopped_redis.stop()
    strict = tier_settings({**entry, "strict_start": True})
    with pytest.raises(BackendUnavailableError):
        open_backend(strict.hicache)
