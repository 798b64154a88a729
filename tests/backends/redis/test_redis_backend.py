"""Redis backend specifics: config errors, secrets kept out of every message, login and
reachability failures, first-wins sets, TTL, cluster key spread and redirections, and failures
counted by reason. Namespaces: test_redis_namespaces.py; deadlines: test_redis_deadline.py."""

from __future__ import annotations

import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import SSLConnection

from hicache_storage import StorageBackend, create_backend
from hicache_storage.backends.redis import RedisBackend, RedisConfig, provision
from hicache_storage.backends.redis.backend import connect
from hicache_storage.config import LayerConfig
from hicache_storage.errors import BackendUnavailableError, ConfigError
from hicache_storage.kit.services import LocalService, free_port

from ...helpers import make_pool

HANG_GUARD_S = 30.0
"""Far above every timeout used here: only a hang, never a slow machine, crosses it."""


def raw_client(service: LocalService) -> Any:
    options = service.options
    if "cluster_nodes" in options:
        nodes = [
            ClusterNode("127.0.0.1", int(n.rsplit(":", 1)[1])) for n in options["cluster_nodes"]
        ]
        return RedisCluster(startup_nodes=nodes, password=options["password"])
    return redis.Redis.from_url(options["url"], password=options["password"])


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "http://127.0.0.1:6379"}, "redis:// or rediss://"),
        ({"url": "redis://:6379"}, "names no host"),
        ({"url": "redis://127.0.0.1:99999"}, "valid port"),
        ({"url": "redis://127.0.0.1:0"}, "port"),
        ({"url": "redis://127.0.0.1:6379/zero"}, "database number"),
        ({"url": "redis://127.0.0.1:6379/99999999999999999999"}, "database number"),
        ({"url": "redis://127.0.0.1:6379/0?timeout=1"}, "query"),
        ({"url": "redis-cluster"}, "redis:// or rediss://"),
        ({}, "exactly one of url and cluster_nodes"),
        ({"url": "redis://h", "cluster_nodes": ["h:1"]}, "exactly one of url and cluster_nodes"),
        ({"cluster_nodes": []}, "at least one"),
        ({"cluster_nodes": ["127.0.0.1"]}, "host:port"),
        ({"cluster_nodes": ["127.0.0.1:0"]}, "TCP port"),
        ({"cluster_nodes": ["127.0.0.1:99999"]}, "TCP port"),
        ({"url": "redis://h/1", "cluster": True}, "only database 0"),
        ({"url": "redis://h", "socket_timeout_s": 6}, "longer than deadline_s"),
        ({"url": "redis://h", "deadline_s": 1, "connect_timeout_s": 2}, "longer than deadline_s"),
        ({"url": "redis://h", "connect_timeout_s": "1"}, "connect_timeout_s"),
        ({"url": "redis://h", "tls_key_file": "k.pem"}, "tls_cert_file"),
        ({"url": "redis://h", "passwd": "x"}, "passwd"),
    ],
)
def test_config_malformed_refused_before_connecting(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_backend("redis", options)


def test_config_url_credentials_and_overrides() -> None:
    config = RedisConfig(url="rediss://alice:s%40cret@cache.example:7000/3")
    (endpoint,) = config.endpoints()
    assert (endpoint.host, endpoint.port, endpoint.db) == ("cache.example", 7000, 3)
    assert (endpoint.username, endpoint.password, endpoint.tls) == ("alice", "s@cret", True)
    override = RedisConfig(url="redis://alice:old@h", password="new", tls=True)
    assert override.endpoints()[0].password == "new" and override.uses_tls
    nodes = RedisConfig(cluster_nodes=["[::1]:7000", "h:7001"])
    assert nodes.is_cluster and [(e.host, e.port) for e in nodes.endpoints()] == [
        ("::1", 7000),
        ("h", 7001),
    ]


NUMERIC_OPTIONS = [
    "ttl_s",
    "deadline_s",
    "socket_timeout_s",
    "connect_timeout_s",
    "pool_size",
    "batch_chunk_size",
]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, -1, 0, True, False])
@pytest.mark.parametrize("option", NUMERIC_OPTIONS)
def test_config_numeric_option_refuses_non_finite_huge_negative_bool(
    option: str, value: object
) -> None:
    with pytest.raises(ConfigError, match=option):
        create_backend("redis", {"url": "redis://h", option: value})


def test_config_timeouts_default_within_the_deadline() -> None:
    config = RedisConfig(url="redis://h")
    assert (config.deadline_s, config.read_timeout_s, config.open_timeout_s) == (5.0, 5.0, 2.0)
    short = RedisConfig(url="redis://h", deadline_s=0.5)
    assert (short.read_timeout_s, short.open_timeout_s) == (0.5, 0.5)
    given = RedisConfig(url="redis://h", deadline_s=3, socket_timeout_s=1, connect_timeout_s=3)
    assert (given.read_timeout_s, given.open_timeout_s) == (1, 3)


# -- secrets ----------------------------------------------------------------------------------

SECRET = "Sup3r-s3cret-pw"


@pytest.mark.parametrize(
    "options",
    [
        {"url": f"redis://alice:{SECRET}@h:99999/0"},
        {"url": f"redis://:{SECRET}@h:0"},
        {"url": f"redis://:{SECRET}@h:6379/notadb"},
        {"url": f"redis://:{SECRET}@h:6379/99999999999999999999"},
        {"url": f"redis://:{SECRET}@h:6379/0?db=1"},
        {"url": f"redis://:{SECRET}@h/1", "cluster": True},
        {"url": "redis://h:99999", "password": SECRET},
        {"url": f"redis://:{SECRET}@h", "deadline_s": math.inf},
    ],
)
def test_password_never_in_config_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("redis", options)
    assert SECRET not in str(caught.value)
    # Built directly (no config layer to mask it), the error names no password either.
    with pytest.raises((ValueError, TypeError)) as direct:
        RedisConfig(**options)
    assert SECRET not in str(direct.value)


def test_password_never_in_repr_or_stats(redis_service: LocalService) -> None:
    password = redis_service.options["password"]
    options = {**redis_service.options, "prefix": "secrets"}
    if "url" in options:
        options["url"] = options["url"].replace("redis://", f"redis://:{password}@")
        del options["password"]
    backend = create_backend("redis", options)
    try:
        shown = [repr(backend), str(backend), repr(backend.stats())]
        bare = RedisBackend(RedisConfig(**options))
        shown += [repr(bare), repr(bare.config), repr(bare.config.endpoints()), repr(bare.stats())]
        bare.close()
        assert not [text for text in shown if password in text], shown
    finally:
        backend.close()


def test_password_never_in_backend_errors_or_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = provision.standalone(tmp_path / "svc")
    password = service.options["password"]
    url = service.options["url"].replace("redis://", f"redis://:{password}@")
    options = {"url": url, "prefix": "secrets", "deadline_s": 1.0, "connect_timeout_s": 0.5}
    messages: list[str] = []
    with service:
        bare = create_backend("redis", options, layers=LayerConfig(degrade=False))
        layered = create_backend("redis", options)
        try:
            service.stop()
            for call in (lambda: bare.get("k"), lambda: bare.batch_set(["k"], [b"v"])):
                with pytest.raises(BackendUnavailableError) as caught:
                    call()
                messages.append(str(caught.value))
            with caplog.at_level(logging.DEBUG):
                assert layered.get("k") is None and layered.batch_exists(["k"]) == 0
            messages += [record.getMessage() for record in caplog.records]
            with pytest.raises(BackendUnavailableError) as unreachable:
                create_backend("redis", options)
            messages.append(str(unreachable.value))
        finally:
            bare.close()
            layered.close()
    wrong = f"redis://:{SECRET}@127.0.0.1:{service.state.processes[0].ports[0]}"
    with service, pytest.raises(ConfigError, match="refused the login") as refused:
        create_backend("redis", {"url": wrong, "prefix": "secrets"})
    messages.append(str(refused.value))
    assert len(messages) >= 5
    assert not [m for m in messages if password in m or SECRET in m], messages


# -- login and reachability -------------------------------------------------------------------


@pytest.mark.parametrize("password", ["wrong-password", None])
def test_wrong_or_missing_password_is_config_error(
    redis_service: LocalService, password: str | None
) -> None:
    options = {**redis_service.options, "password": password}
    with pytest.raises(ConfigError, match="refused the login"):
        create_backend("redis", options)


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_unreachable_host_is_unavailable_at_construction(mode: str) -> None:
    port = free_port()
    where: dict[str, Any] = (
        {"url": f"redis://127.0.0.1:{port}"}
        if mode == "standalone"
        else {"cluster_nodes": [f"127.0.0.1:{port}"]}
    )
    start = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=f"cannot reach redis.*127.0.0.1:{port}"):
        create_backend("redis", {**where, "connect_timeout_s": 0.5, "socket_timeout_s": 0.5})
    assert time.monotonic() - start < HANG_GUARD_S


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        accepted: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            listener.settimeout(0.1)
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0])
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield int(listener.getsockname()[1])
        finally:
            stop.set()
            thread.join()
            for conn in accepted:
                conn.close()


def test_hung_server_fails_within_timeouts(silent_server: int) -> None:
    start = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=r"within deadline_s=1s"):
        create_backend(
            "redis",
            {
                "url": f"redis://127.0.0.1:{silent_server}",
                "deadline_s": 1.0,
                "connect_timeout_s": 0.5,
            },
        )
    assert time.monotonic() - start < 1.0 + 1.0


# -- behaviour against a real server ----------------------------------------------------------


def test_set_keeps_first_complete_value(make: Callable[..., StorageBackend]) -> None:
    backend = make(prefix="first-wins:")
    assert backend.set("k", b"first value")
    assert backend.set("k", b"second, longer value")
    assert backend.get("k") == b"first value"
    assert backend.batch_set(["k", "j"], [b"third", b"j value"]) == [True, True]
    assert backend.get("k") == b"first value" and backend.get("j") == b"j value"


def test_keys_live_under_prefix(
    make: Callable[..., StorageBackend], redis_service: LocalService
) -> None:
    backend = make(prefix="ns1")
    assert backend.set("page-0", b"abc")
    raw = raw_client(redis_service)
    try:
        assert raw.get(b"ns1:page-0") == b"abc" and raw.get(b"page-0") is None
        # The old default form with a trailing ':' names the same objects.
        assert make(prefix="ns1:").get("page-0") == b"abc"
    finally:
        raw.close()


def test_ttl_sets_expiry(make: Callable[..., StorageBackend], redis_service: LocalService) -> None:
    backend = make(prefix="ttl:", ttl_s=60)
    assert backend.capabilities.ttl
    assert backend.set("a", b"x") and backend.batch_set(["b"], [b"y"]) == [True]
    pool = make_pool("mha", "layer_first")  # a page of several buffers: the Lua path
    backend.register_host_pool(pool)
    assert backend.batch_set_v1(["page"], list(range(pool.page_size))) == [True]
    raw = raw_client(redis_service)
    try:
        for name in (b"ttl:a", b"ttl:b", b"ttl:page"):
            assert 0 < raw.pttl(name) <= 60_000
    finally:
        raw.close()
    assert not make(prefix="ttl:").capabilities.ttl


def test_cluster_spreads_keys_over_every_primary(redis_cluster: LocalService) -> None:
    options = redis_cluster.options
    backend = create_backend("redis", {**options, "prefix": "spread:"})
    nodes = [
        redis.Redis(port=int(node.rsplit(":", 1)[1]), password=options["password"])
        for node in options["cluster_nodes"]
    ]
    try:
        keys = [f"page-{i}" for i in range(60)]
        assert backend.batch_set(keys, [key.encode() for key in keys]) == [True] * 60
        outs = [bytearray(len(key)) for key in keys]
        assert backend.batch_get(keys, outs) == [True] * 60
        assert [bytes(out) for out in outs] == [key.encode() for key in keys]
        per_node = [len(list(node.scan_iter(match="spread:*", count=1000))) for node in nodes]
        assert sum(per_node) == 60 and all(count > 0 for count in per_node), per_node
    finally:
        backend.clear()
        backend.close()
        for node in nodes:
            node.close()


def test_outage_errors_counted_by_reason_then_recovers(tmp_path: Path) -> None:
    service = provision.standalone(tmp_path / "svc")
    with service:
        layers = LayerConfig(degrade=False)
        backend = create_backend("redis", {**service.options, "prefix": "outage:"}, layers=layers)
        try:
            assert backend.set("k", b"v")
            service.stop()
            with pytest.raises(BackendUnavailableError, match="unavailable"):
                backend.get("k")
            with pytest.raises(BackendUnavailableError):
                backend.batch_exists(["k"])
            service.start()
            assert backend.set("k", b"back") and backend.get("k") == b"back"
            assert backend.stats()["errors"] == {"unavailable": 2}
        finally:
            backend.close()


def test_batches_pipelined_in_chunks(redis_service: LocalService) -> None:
    config = RedisConfig(**{**redis_service.options, "prefix": "bare:", "batch_chunk_size": 4})
    with RedisBackend(config) as backend:
        keys = [f"k{i}" for i in range(10)]
        assert backend.batch_set(keys, [b"v"] * 10) == [True] * 10
        stats = backend.stats()
        assert stats["mode"] == ("cluster" if config.is_cluster else "standalone")
        assert stats["round_trips"] == 3 and stats["errors"] == {}
        # The first gap ends the call: chunks [k0..k3] and [k4, absent, ...], not the third.
        assert backend.batch_exists([*keys[:5], "absent", *keys[5:]]) == 5
        assert backend.stats()["round_trips"] == 5
        backend.clear()


def test_tls_options_reach_the_connection() -> None:
    config = RedisConfig(url="rediss://cache.example:6380", tls_ca_file="/ca.pem", tls_verify=False)
    client = connect(config)
    try:
        conn = client.connection_pool.make_connection()
        assert isinstance(conn, SSLConnection)
        assert (conn.host, conn.port, conn.ca_certs) == ("cache.example", 6380, "/ca.pem")
        assert conn.cert_reqs == ssl.CERT_NONE and conn.check_hostname is False
    finally:
        client.connection_pool.disconnect()


def test_cluster_follows_moved_replies_from_a_stale_slot_map(redis_cluster: LocalService) -> None:
    config = RedisConfig(**{**redis_cluster.options, "prefix": "moved"})
    with RedisBackend(config) as backend:
        keys = [f"m{i}" for i in range(30)]
        assert backend.batch_set(keys, [key.encode() for key in keys]) == [True] * 30
        nodes = backend._nodes
        nodes._slots = [nodes.primaries()[0]] * 16384  # as if every slot had moved to one node
        outs = [bytearray(len(key)) for key in keys]
        assert backend.batch_get(keys, outs) == [True] * 30
        assert [bytes(out) for out in outs] == [key.encode() for key in keys]
        assert len(nodes.primaries()) == 3  # the MOVED replies patched the map
        assert backend.batch_exists(keys) == 30 and backend.delete(keys[0])
        assert backend.stats()["errors"] == {}
        backend.clear()
