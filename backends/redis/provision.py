"""Local Redis servers for tests and benchmarks: one standalone server or a Redis Cluster.

Each server runs ``redis-server`` from ``PATH`` with a config file written under the service's
work directory: bound to 127.0.0.1, a password (so that a wrong one is really refused), no
persistence to disk, and ``set-proc-title no`` so the process keeps the command line it was
started with (the service recognises its PIDs by it). A cluster node keeps its ``nodes.conf`` in
its own data directory, so a node restarted by the fault checks rejoins the same cluster; the
readiness hook creates the cluster only on the first start and then waits until every node
reports ``cluster_state:ok``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from hicache_storage.errors import BackendUnavailableError
from hicache_storage.kit.services import (
    LocalService,
    ProcessSpec,
    ServiceState,
    free_port,
)

__all__ = ["TEST_PASSWORD", "cluster", "standalone", "wait_ready"]

TEST_PASSWORD = "hicache-test-password"
"""The ``requirepass`` of the servers this module starts."""

_SLOTS = 16384
_READY = "hicache_storage.backends.redis.provision:wait_ready"


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise BackendUnavailableError(
            "redis-server is not on PATH; install it (Debian: apt-get install redis-server)"
        )
    return found


def _server_conf(directory: Path, port: int, password: str, extra: dict[str, str]) -> Path:
    """Write ``redis.conf`` for one server whose data directory is ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = {
        "bind": "127.0.0.1",
        "port": str(port),
        "dir": str(directory),
        "daemonize": "no",
        "set-proc-title": "no",
        "save": '""',
        "appendonly": "no",
        "requirepass": password,
        "masterauth": password,
        "logfile": '""',
        **extra,
    }
    conf = directory / "redis.conf"
    conf.write_text("".join(f"{name} {value}\n" for name, value in settings.items()))
    return conf


def _options(
    password: str, deadline_s: float, socket_timeout_s: float, connect_timeout_s: float
) -> dict[str, Any]:
    return {
        "password": password,
        "deadline_s": deadline_s,
        "socket_timeout_s": min(socket_timeout_s, deadline_s),
        "connect_timeout_s": min(connect_timeout_s, deadline_s),
    }


def standalone(
    workdir: str | os.PathLike[str],
    *,
    port: int | None = None,
    password: str = TEST_PASSWORD,
    maxmemory: str | None = None,
    deadline_s: float = 3.0,
    socket_timeout_s: float = 2.0,
    connect_timeout_s: float = 1.0,
) -> LocalService:
    """Describe one ``redis-server`` on 127.0.0.1 (a free port unless ``port`` is given).

    ``maxmemory`` (e.g. ``"64mb"``) bounds the server with the ``allkeys-lru`` policy. The
    service's ``options`` are the backend options that reach it (add a ``prefix`` of your own);
    its ``timeout_s``, the bound the fault checks hold every call to, is their ``deadline_s``.
    """
    root = Path(workdir)
    port = port or free_port()
    extra = {} if maxmemory is None else {"maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru"}
    conf = _server_conf(root / f"redis-{port}", port, password, extra)
    state = ServiceState(
        backend="redis",
        options={
            "url": f"redis://127.0.0.1:{port}/0",
            **_options(password, deadline_s, socket_timeout_s, connect_timeout_s),
        },
        processes=[
            ProcessSpec(name=f"redis-{port}", argv=[_redis_server(), str(conf)], ports=[port])
        ],
        workdir=str(root),
        ready=_READY,
        timeout_s=deadline_s,
        start_timeout_s=30.0,
    )
    return LocalService(state, root / "redis-service.json")


def cluster(
    workdir: str | os.PathLike[str],
    *,
    masters: int = 3,
    ports: list[int] | None = None,
    password: str = TEST_PASSWORD,
    node_timeout_ms: int = 3000,
    deadline_s: float = 3.0,
    socket_timeout_s: float = 2.0,
    connect_timeout_s: float = 1.0,
    pause_all: bool = False,
) -> LocalService:
    """Describe a Redis Cluster of ``masters`` primaries (no replicas) on 127.0.0.1.

    Each node also opens its cluster bus at ``port + 10000``, so free ports are chosen with that
    one free too. :meth:`~LocalService.pause` freezes only the first primary (every node with
    ``pause_all``): a batch then meets nodes that answer and one that hangs, the case where a
    client that retries the hung node's commands one by one overruns its deadline.
    """
    root = Path(workdir)
    chosen = ports or [free_port(also=(10000,)) for _ in range(masters)]
    if len(set(chosen)) != len(chosen) or len(chosen) < 1:
        raise ValueError(f"cluster needs distinct ports, got {chosen}")
    server = _redis_server()
    processes = []
    for port in chosen:
        extra = {
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(node_timeout_ms),
        }
        conf = _server_conf(root / f"node-{port}", port, password, extra)
        processes.append(
            ProcessSpec(name=f"node-{port}", argv=[server, str(conf)], ports=[port, port + 10000])
        )
    state = ServiceState(
        backend="redis",
        options={
            "cluster_nodes": [f"127.0.0.1:{port}" for port in chosen],
            **_options(password, deadline_s, socket_timeout_s, connect_timeout_s),
        },
        processes=processes,
        workdir=str(root),
        ready=_READY,
        timeout_s=deadline_s,
        pause_targets=None if pause_all else [processes[0].name],
        start_timeout_s=60.0,
    )
    return LocalService(state, root / "redis-cluster-service.json")


def _cluster_info(client: Any) -> dict[str, str]:
    text = client.execute_command("CLUSTER", "INFO")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _create_cluster(clients: list[Any], ports: list[int]) -> None:
    """Give each node an equal share of the slots and a distinct epoch, then join them."""
    n = len(clients)
    for i, client in enumerate(clients):
        first, last = i * _SLOTS // n, (i + 1) * _SLOTS // n - 1
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
    for port in ports[1:]:
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)


def wait_ready(service: LocalService, deadline: float) -> None:
    """Readiness hook: the server answers an authenticated PING; a cluster is formed and ok.

    Raises
    ------
    BackendUnavailableError
        If that does not happen before ``deadline`` (``time.monotonic()``).
    """
    import redis

    password = service.options.get("password")
    ports = [process.ports[0] for process in service.state.processes]
    clients = [
        redis.Redis(
            host="127.0.0.1",
            port=port,
            password=password,
            socket_timeout=5,
            socket_connect_timeout=5,
        )
        for port in ports
    ]
    created = False
    last: object = None
    try:
        while time.monotonic() < deadline:
            try:
                for client in clients:
                    client.ping()
                if "cluster_nodes" not in service.options:
                    return
                infos = [_cluster_info(client) for client in clients]
                fresh = all(
                    info.get("cluster_known_nodes") == "1"
                    and info.get("cluster_slots_assigned") == "0"
                    for info in infos
                )
                if fresh and not created:
                    _create_cluster(clients, ports)
                    created = True
                    continue
                if all(
                    info.get("cluster_state") == "ok"
                    and info.get("cluster_known_nodes") == str(len(ports))
                    for info in infos
                ):
                    return
                last = infos
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.1)
    finally:
        for client in clients:
            client.close()
    raise BackendUnavailableError(f"redis service in {service.state.workdir} not ready: {last}")
