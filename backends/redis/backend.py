"""The Redis backend: one Redis string per key, on a standalone server or a Redis Cluster.

Keys
    Key ``k`` is stored as ``<namespace>:k`` (``prefix`` without its trailing ``:``). Keys never
    hold ``:``, so the name says where the namespace ends: ``clear()`` walks
    ``SCAN MATCH <namespace>:*`` (every primary of a cluster) and unlinks only names whose rest
    holds no ``:``, never the objects of another prefix, nested (``ns:sub``) or longer (``ns2``).

Writes
    ``SET key value NX [PX ttl]``: the first complete value wins, and Redis applies a command
    only once it has received all of it, so a reader sees the whole value or nothing, and a
    writer killed mid-send leaves nothing. Values go to the socket as they are (memoryviews of
    the caller's buffer), never joined or copied first. A host-pool page made of several buffers
    is sent as separate arguments of a short Lua script that concatenates them on the server and
    sets the key if absent, atomically.

Reads
    ``GET``; the reply is copied once, straight into the caller's buffer or the page's buffers,
    after its size is checked.

Batches
    Pipelined in chunks of ``batch_chunk_size`` keys: one round trip per chunk (the commands of
    every node written before any reply is read), one single-key command per key, so nothing
    crosses cluster slots.

Deadline
    Every call runs under one deadline, ``deadline_s`` from its start, kept in a thread-local
    that each socket operation reads: a pooled-connection wait, a connect, a send and every
    ``recv`` get at most the time left (and at most the per-operation timeouts). The backend
    routes cluster commands itself (slot map from ``CLUSTER SLOTS``, ``MOVED``/``ASK`` followed
    at most twice while time is left) on redis-py connections and pools with retries off, so
    no client-library loop retries, sleeps or waits on a lock past the deadline. Nothing runs
    in the background: when a call returns or raises, nothing of it writes anywhere any more.

Closing
    ``close()`` refuses new calls at once and disconnects the pools only once the calls in
    flight are done (:func:`~hicache_storage.kit.closed_guard`, waiting up to ``deadline_s``),
    so no call ever finds its connection closed under it.

Failures
    Every exception is translated by one :class:`~hicache_storage.kit.ErrorMap` into a typed
    error whose message never holds a password; the default layers turn it into a miss.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import redis
import redis.exceptions as rx
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import (
    AbstractConnection,
    BlockingConnectionPool,
    Connection,
    HiredisRespSerializer,
    PythonRespSerializer,
    SSLConnection,
)
from redis.crc import key_slot
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE
from typing_extensions import Buffer

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import as_readable, as_writable, scatter
from hicache_storage.capacity import Capacity
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
    HiCacheError,
)
from hicache_storage.kit import (
    Deadline,
    ErrorMap,
    Verdict,
    bounded,
    closed_guard,
    current_deadline,
    flat,
)
from hicache_storage.quota import RedisLedger
from hicache_storage.redact import redact_text

from .config import MAX_VALUE_SIZE, RedisConfig, capabilities

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_VALUE_SIZE", "RedisBackend", "connect"]


_SCAN_COUNT = 1000
_READ_SIZE = 1 << 18
"""Socket read size: large values arrive in fewer ``recv`` calls than redis-py's 64 KiB."""
_SLOTS = 16384
_REDIRECTS = 2
"""``MOVED``/``ASK`` replies followed per command and call (time allowing)."""
_REARM_S = 0.01
"""How far a socket operation may end past the deadline, or short of its time, before the
socket's timeout is set again (see :class:`_DeadlineSocket`)."""
_REFRESH_INTERVAL_S = 1.0
"""Least time between two slot-map reloads a failure asks for (a ``MOVED`` is patched at once)."""

# Set the key to the concatenation of ARGV[2..] unless it exists; ARGV[1] is the TTL in ms (0:
# none). One script call is atomic, so readers see the whole page or nothing.
_SET_PARTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local value = table.concat(ARGV, '', 2)
local ttl = tonumber(ARGV[1])
if ttl > 0 then redis.call('SET', KEYS[1], value, 'PX', ttl)
else redis.call('SET', KEYS[1], value) end
return 1
"""

# -- the per-call deadline ----------------------------------------------------------------------


class _DeadlineSocket:
    """A connected socket whose every send and receive waits at most the call's time left.

    redis-py sets one timeout per socket and reads a large reply in many ``recv`` calls; this
    wrapper re-arms the timeout before each, so no sequence of operations outlasts the
    deadline (by more than :data:`_REARM_S`, which spares a syscall per operation of a busy
    pipeline). ``settimeout`` from redis-py sets the per-operation cap.
    """

    def __init__(self, sock: socket.socket, cap: float | None) -> None:
        self._sock = sock
        self._cap = cap
        self._applied = cap

    def _arm(self) -> None:
        deadline = current_deadline()
        if deadline is None:
            if self._applied != self._cap:
                self.settimeout(self._cap)
            return
        left = deadline.left()
        if left <= 0:
            raise TimeoutError("the call's deadline has passed")
        want = left if self._cap is None else min(self._cap, left)
        applied = self._applied
        if applied is None or not want - _REARM_S <= applied <= left + _REARM_S:
            self._sock.settimeout(want)
            self._applied = want

    def settimeout(self, value: float | None) -> None:
        self._cap = value
        self._sock.settimeout(value)
        self._applied = value

    def gettimeout(self) -> float | None:
        return self._cap

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> int:
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> None:
        self._arm()
        self._sock.sendall(*args)

    def fileno(self) -> int:
        return self._sock.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlinePool(BlockingConnectionPool):
    """A blocking pool whose wait for a free connection ends with the call's deadline."""

    _wait_cap: float | None = None

    @property
    def timeout(self) -> float | None:
        """The configured wait, cut to the time left (0 once it is up: take a free one or fail)."""
        try:
            return bounded(self._wait_cap)
        except TimeoutError:
            return 0.0

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._wait_cap = value


# -- connections --------------------------------------------------------------------------------


class _PassThroughPacker:
    """Hand memoryview arguments to ``sendall`` untouched; pack everything else with hiredis.

    redis-py's default (hiredis) packer copies every memoryview into ``bytes`` and then the
    whole command into one more buffer; its pure-Python packer passes memoryviews through but
    packs small commands several times slower. A value is always a memoryview here, so a
    command that carries one takes the Python path and every other one (GET, EXISTS) hiredis.
    """

    def __init__(self, buffer_cutoff: int, encode: Callable[[Any], Any]) -> None:
        self._python = PythonRespSerializer(buffer_cutoff, encode)
        # HiredisRespSerializer.__init__ is untyped in some redis-py releases (8.2.0).
        fast = HiredisRespSerializer() if HIREDIS_AVAILABLE else None  # type: ignore[no-untyped-call, unused-ignore]
        self._fast: Any = self._python if fast is None else fast

    def pack(self, *args: Any) -> Any:
        for arg in args:
            if isinstance(arg, memoryview):
                return self._python.pack(*args)  # type: ignore[no-untyped-call]
        return self._fast.pack(*args)


def _connection_class(
    config: RedisConfig, *, pass_through: bool, deadline: bool = False
) -> type[AbstractConnection]:
    """Return the connection class for ``config``, with its TLS settings baked in.

    With ``pass_through``, values go to the socket as they are (see :class:`_PassThroughPacker`);
    with ``deadline``, connecting and every socket operation honour the call's deadline.
    """
    tls: dict[str, Any] = {}
    base: type[Connection] = Connection
    if config.uses_tls:
        base = SSLConnection
        tls = {
            "ssl_ca_certs": config.tls_ca_file,
            "ssl_certfile": config.tls_cert_file,
            "ssl_keyfile": config.tls_key_file,
            "ssl_cert_reqs": "required" if config.tls_verify else "none",
            "ssl_check_hostname": config.tls_verify,
        }

    class ConfiguredConnection(base):  # type: ignore[valid-type,misc]
        """A redis-py connection with this config's TLS settings (and packer)."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**{**kwargs, **tls})

        def _construct_command_packer(self, packer: Any) -> Any:
            if packer is not None or not pass_through:
                return super()._construct_command_packer(packer)
            return _PassThroughPacker(self._buffer_cutoff, self.encoder.encode)

        def _connect(self) -> Any:
            if not deadline:
                return super()._connect()
            me: Any = self  # redis-py's attributes are untyped
            connect_cap: float | None = me.socket_connect_timeout
            socket_cap: float | None = me.socket_timeout
            try:
                self.socket_connect_timeout = bounded(connect_cap)
                self.socket_timeout = bounded(socket_cap)  # the TLS handshake's bound
                sock = super()._connect()
            finally:
                self.socket_connect_timeout, self.socket_timeout = connect_cap, socket_cap
            return _DeadlineSocket(sock, socket_cap)

    return ConfiguredConnection


def _client_options(config: RedisConfig, *, pass_through: bool, deadline: bool) -> dict[str, Any]:
    first = config.endpoints()[0]
    return {
        "username": first.username,
        "password": first.password,
        "socket_timeout": config.read_timeout_s,
        "socket_connect_timeout": config.open_timeout_s,
        "socket_read_size": _READ_SIZE if pass_through else 65536,
        "connection_class": _connection_class(config, pass_through=pass_through, deadline=deadline),
    }


def connect(config: RedisConfig, *, pass_through: bool = True) -> Any:
    """Build the plain redis-py client ``config`` describes, with client retries off.

    The backend routes commands itself (see the module docstring); this client is what the raw
    baseline measures. A standalone client does no I/O yet; a cluster client contacts a seed
    node at once to learn the slot map. ``pass_through=False`` keeps redis-py's default packer.
    """
    endpoints = config.endpoints()
    first = endpoints[0]
    common = _client_options(config, pass_through=pass_through, deadline=False)
    no_retry = Retry(NoBackoff(), 0)
    if config.is_cluster:
        # Only the URL form makes redis-py build each node's pool from our pool and connection
        # classes; the URL carries just the first seed's address (TLS is in the class).
        host = f"[{first.host}]" if ":" in first.host else first.host
        return RedisCluster(
            url=f"redis://{host}:{first.port}",
            startup_nodes=[
                ClusterNode(e.host, e.port)  # type: ignore[no-untyped-call]
                for e in endpoints[1:]
            ],
            retry=no_retry,
            connection_pool_class=BlockingConnectionPool,
            max_connections=config.pool_size,
            timeout=config.read_timeout_s,
            **common,
        )
    pool = BlockingConnectionPool(  # type: ignore[no-untyped-call]
        max_connections=config.pool_size,
        timeout=config.read_timeout_s,
        host=first.host,
        port=first.port,
        db=first.db,
        retry=no_retry,
        **common,
    )
    return redis.Redis(connection_pool=pool)


# -- routing ------------------------------------------------------------------------------------


def _node_name(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_node(name: str) -> tuple[str, int]:
    host, _, port = name.rpartition(":")
    return host.strip("[]"), int(port)


def _read(conn: Any) -> Any:
    """Read one reply; an error reply comes back as its exception object, not raised."""
    try:
        return conn.read_response()
    except rx.ResponseError as exc:
        return exc


class _Nodes:
    """The servers of one backend: one, or a cluster's primaries and which slot each serves.

    Every command goes through :meth:`run`, one round trip per node, on pools of
    :class:`_DeadlinePool`; nothing retries on its own.
    """

    def __init__(self, config: RedisConfig) -> None:
        endpoints = config.endpoints()
        self.cluster = config.is_cluster
        self._seeds = [_node_name(e.host, e.port) for e in endpoints]
        self._pool_options = {
            **_client_options(config, pass_through=True, deadline=True),
            "db": endpoints[0].db,
            "max_connections": config.pool_size,
            "timeout": config.read_timeout_s,
            "retry": Retry(NoBackoff(), 0),
            # RESP2: replies only, in order; no push messages between a pipeline's replies.
            "protocol": 2,
        }
        self._pools: dict[str, _DeadlinePool] = {}
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._slots: list[str | None] | None = None
        self._refresh_due = self.cluster
        self._refreshed_at = -math.inf
        self._failed: dict[str, float] = {}

    # topology

    def primaries(self) -> list[str]:
        """Return the nodes that hold keys: the server, or every primary of the cluster."""
        if not self.cluster:
            return self._seeds[:1]
        return sorted({node for node in self._slots or () if node is not None})

    def node_of(self, name: bytes) -> str:
        """Return the node that serves ``name``.

        Raises
        ------
        redis.exceptions.ClusterDownError
            If no node is known to serve its slot.
        """
        if not self.cluster:
            return self._seeds[0]
        slot = key_slot(name)
        node = self._slots[slot] if self._slots is not None else None
        if node is None:
            raise rx.ClusterDownError(f"no node of the cluster is known to serve slot {slot}")
        return node

    def prepare(self) -> None:
        """Reload the slot map when it is missing, or due and no other thread is reloading it."""
        if not self._refresh_due or not self.cluster:
            return
        if self._slots is None:
            if not self._refresh_lock.acquire(timeout=bounded(None) or -1):
                raise rx.TimeoutError("another call is loading the cluster's slot map")
        elif time.monotonic() - self._refreshed_at < _REFRESH_INTERVAL_S or (
            not self._refresh_lock.acquire(blocking=False)
        ):
            return
        try:
            if self._refresh_due:
                self._refresh()
        except (rx.RedisError, OSError):
            if self._slots is None:
                raise
        finally:
            self._refresh_lock.release()

    def _refresh(self) -> None:
        """Load the slot map from the first node that answers, nodes that failed last."""
        self._refreshed_at = time.monotonic()
        known = [node for node in self.primaries() if node not in self._seeds]
        candidates = sorted([*self._seeds, *known], key=lambda n: self._failed.get(n, -math.inf))
        best: list[str | None] | None = None
        error: Exception = rx.ConnectionError("no cluster node to ask for the slot map")
        for node in candidates:
            try:
                reply = self.run([("CLUSTER", "SLOTS")], [node])[0]
            except rx.AuthenticationError:
                raise
            except (rx.ConnectionError, rx.TimeoutError) as exc:
                error = exc
                continue
            if isinstance(reply, Exception):
                error = reply
                continue
            slots = _parse_slots(reply, _split_node(node)[0])
            if best is None or slots.count(None) < best.count(None):
                best = slots
            if None not in slots:
                break
        if best is None:
            raise error
        self._slots = best
        self._refresh_due = False

    def failed(self, node: str) -> None:
        """Note that ``node`` did not answer: try it last, and reload the slot map soon."""
        self._failed[node] = time.monotonic()
        self._refresh_due = self.cluster

    def _moved(self, exc: rx.MovedError) -> str:
        node = _node_name(exc.host, exc.port)
        if self._slots is not None:
            self._slots[exc.slot_id] = node
        self._refresh_due = True
        return node

    # commands

    def pool(self, node: str) -> _DeadlinePool:
        """Return the connection pool of ``node``, made on first use."""
        pool = self._pools.get(node)
        if pool is None:
            with self._lock:
                pool = self._pools.get(node)
                if pool is None:
                    host, port = _split_node(node)
                    pool = _DeadlinePool(host=host, port=port, **self._pool_options)  # type: ignore[no-untyped-call]
                    self._pools[node] = pool
        return pool

    def run(self, commands: Sequence[tuple[Any, ...]], nodes: Sequence[str]) -> list[Any]:
        """Send ``commands[i]`` to ``nodes[i]``, pipelined per node; return replies in order.

        Error replies come back as exception objects. A ``MOVED``/``ASK`` reply is followed
        (at most :data:`_REDIRECTS` times, time allowing).

        Raises
        ------
        redis.exceptions.ConnectionError, redis.exceptions.TimeoutError
            If a node cannot be reached or does not answer within the call's deadline.
        """
        targets = list(nodes)
        replies: list[Any] = [None] * len(commands)
        pending: Sequence[int] = range(len(commands))
        asking: set[int] = set()
        for _ in range(_REDIRECTS + 1):
            self._exchange(commands, targets, pending, asking, replies)
            pending = [i for i in pending if isinstance(replies[i], rx.AskError)]
            asking = set()
            for i in pending:
                error = replies[i]
                if isinstance(error, rx.MovedError):
                    targets[i] = self._moved(error)
                else:
                    targets[i] = _node_name(error.host, error.port)
                    asking.add(i)
            if not pending:
                break
        return replies

    def _exchange(
        self,
        commands: Sequence[tuple[Any, ...]],
        targets: Sequence[str],
        indices: Sequence[int],
        asking: set[int],
        replies: list[Any],
    ) -> None:
        """One round trip: write every node's commands, then read every node's replies."""
        groups: dict[str, list[int]] = {}
        for i in indices:
            groups.setdefault(targets[i], []).append(i)
        held: list[tuple[_DeadlinePool, Any]] = []
        done = 0
        try:
            for node, group in groups.items():
                pool = self.pool(node)
                try:
                    conn = pool.get_connection()  # type: ignore[no-untyped-call]
                    held.append((pool, conn))
                    wire: list[tuple[Any, ...]] = []
                    for i in group:
                        if i in asking:
                            wire.append(("ASKING",))
                        wire.append(commands[i])
                    conn.send_packed_command(conn.pack_commands(wire), check_health=False)
                except (rx.ConnectionError, rx.TimeoutError):
                    self.failed(node)
                    raise
            for (node, group), (_, conn) in zip(groups.items(), held, strict=True):
                try:
                    for i in group:
                        if i in asking:
                            _read(conn)
                        replies[i] = _read(conn)
                except (rx.ConnectionError, rx.TimeoutError):
                    self.failed(node)
                    raise
                done += 1
        finally:
            for index, (pool, conn) in enumerate(held):
                if index >= done:
                    conn.disconnect()  # replies may still be on their way: never reuse it
                pool.release(conn)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Close every connection of every pool."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            with contextlib.suppress(rx.RedisError, OSError):
                pool.disconnect()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_slots(reply: Any, asked_host: str) -> list[str | None]:
    """Return the primary of each slot from a ``CLUSTER SLOTS`` reply (None: not served)."""
    slots: list[str | None] = [None] * _SLOTS
    for entry in reply:
        start, end, primary = int(entry[0]), int(entry[1]), entry[2]
        host = _text(primary[0]) or asked_host
        if host == "?":
            continue
        node = _node_name(host, int(primary[1]))
        slots[start : end + 1] = [node] * (end + 1 - start)
    return slots


# -- errors -------------------------------------------------------------------------------------


def _where(config: RedisConfig) -> str:
    kind = "cluster " if config.is_cluster else ""
    nodes = ",".join(_node_name(e.host, e.port) for e in config.endpoints())
    return f"redis {kind}{nodes}"


_CAUGHT = (rx.RedisError, rx.RedisClusterException, OSError)


class _RedisErrors(ErrorMap):
    """Map a redis-py (or socket) exception to its typed error; the one place that does.

    Messages are scrubbed of the configured passwords; each error is counted by reason
    (``auth``, ``timeout``, ``unavailable``, ``out_of_memory``, ``error``).
    """

    def __init__(self, config: RedisConfig) -> None:
        super().__init__(_where(config), secrets=config.secrets(), catch=_CAUGHT)
        self.deadline_s = config.deadline_s

    def describe(self, exc: BaseException, what: str) -> Verdict:
        where = self.service
        cause = exc.__cause__
        if isinstance(exc, rx.RedisClusterException) and isinstance(cause, rx.RedisError):
            exc = cause
        if isinstance(exc, rx.AuthenticationError):
            message = f"{where} refused the login (username/password): {exc}"
            return Verdict(BackendUnavailableError, message, "auth", retryable=False)
        if isinstance(exc, (rx.TimeoutError, TimeoutError)):
            message = f"{where} did not answer within deadline_s={self.deadline_s:g}s: {exc}"
            return Verdict(BackendTimeoutError, message, "timeout")
        if isinstance(exc, (rx.ConnectionError, rx.ClusterError, rx.RedisClusterException)):
            return Verdict(BackendUnavailableError, f"{where} is unavailable: {exc}", "unavailable")
        if isinstance(exc, (rx.ReadOnlyError, rx.TryAgainError, rx.AskError)):
            message = f"{where} cannot serve the key now: {exc}"
            return Verdict(BackendUnavailableError, message, "unavailable")
        if isinstance(exc, rx.OutOfMemoryError) or str(exc).startswith("OOM"):
            message = f"{where} is full (maxmemory with a noeviction policy): {exc}"
            return Verdict(BackendIOError, message, "out_of_memory")
        if isinstance(exc, OSError) and not isinstance(exc, rx.RedisError):
            return Verdict(BackendUnavailableError, f"{where} is unavailable: {exc}", "unavailable")
        return Verdict(BackendIOError, f"{where} failed: {type(exc).__name__}: {exc}", "error")


def _info_fields(reply: Any) -> dict[str, str]:
    """Return the ``name:value`` lines of an ``INFO`` reply as a dict."""
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
    fields = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("#"):
            fields[name.strip()] = value.strip()
    return fields


def _chunks(count: int, size: int) -> Iterator[slice]:
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


@closed_guard
class RedisBackend(StorageBackend):
    """Stores each key as one Redis string under ``config.prefix``; see the module docstring.

    Construction checks the server with a ``PING`` (a cluster: loads the slot map), within
    ``deadline_s``.

    Parameters
    ----------
    config
        The backend's settings.
    deployment
        Unused: every rank of a deployment shares the one keyspace under ``prefix``.

    Raises
    ------
    ConfigError
        If the server refuses the username or password.
    BackendUnavailableError
        If no server answers within ``deadline_s``.
    """

    name = "redis"

    def __init__(self, config: RedisConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.config = config
        self.deployment = deployment if deployment is not None else Deployment()
        self.capabilities = capabilities(config)
        self._where = _where(config)
        self._namespace = config.namespace.encode("ascii") + b":"
        self._chunk = config.batch_chunk_size
        self._ttl_ms = 0 if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._set_args: tuple[Any, ...] = () if not self._ttl_ms else ("PX", self._ttl_ms)
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._error_map = _RedisErrors(config)
        self._round_trips = 0
        self._nodes = _Nodes(config)
        try:
            with Deadline(config.deadline_s).applied():
                if self._nodes.cluster:
                    self._nodes.prepare()
                else:
                    reply = self._nodes.run([("PING",)], self._nodes.primaries())[0]
                    if isinstance(reply, Exception):
                        raise reply
        except _CAUGHT as exc:
            self._nodes.close()
            raise self._open_error(exc) from exc

    def _open_error(self, exc: BaseException) -> Exception:
        reason = self._error_map.describe(exc, "open").reason
        if reason == "auth" or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            return ConfigError(f"{self._where} refused the login: check username and password")
        if reason in ("unavailable", "timeout"):
            return BackendUnavailableError(
                redact_text(
                    f"cannot reach {self._where} within deadline_s={self.config.deadline_s:g}s "
                    f"(connect_timeout_s={self.config.open_timeout_s:g}s, socket_timeout_s="
                    f"{self.config.read_timeout_s:g}s): {exc}",
                    self.config.secrets(),
                )
            )
        return self._error_map.translate(exc, "open")

    @property
    def close_timeout_s(self) -> float:
        """How long ``close()`` waits for calls in flight: ``deadline_s``, which bounds each."""
        return self.config.deadline_s

    # -- plumbing -------------------------------------------------------------------------------

    def _name(self, key: str) -> bytes:
        return self._namespace + key.encode("ascii")

    def _owns(self, name: bytes) -> bool:
        """Whether ``name`` is ``<namespace>:<key>`` of this namespace (not a nested one)."""
        return name.startswith(self._namespace) and b":" not in name[len(self._namespace) :]

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Bound the block by ``deadline_s``; translate exceptions into typed errors, counted."""
        with Deadline(self.config.deadline_s).applied(), self._error_map.guard("call", self._count):
            yield

    def _count(self, reason: str) -> None:
        with self._lock:
            self._errors[reason] += 1

    def _run(self, commands: Sequence[tuple[Any, ...]], names: Sequence[bytes]) -> list[Any]:
        """Run one round trip of single-key commands (``names[i]`` routes ``commands[i]``).

        Raises the first error reply; the caller holds :meth:`_calling`.
        """
        nodes = self._nodes
        nodes.prepare()
        replies = nodes.run(commands, [nodes.node_of(name) for name in names])
        with self._lock:
            self._round_trips += 1
        for reply in replies:
            if isinstance(reply, Exception):
                if isinstance(reply, (rx.ClusterDownError, rx.TryAgainError, rx.AskError)):
                    nodes.failed(nodes.node_of(names[0]))
                raise reply
        return replies

    def _single(self, command: tuple[Any, ...], name: bytes) -> Any:
        with self._calling():
            return self._run([command], [name])[0]

    def _pipelined(
        self,
        names: Sequence[bytes],
        stage: Callable[[slice], list[tuple[Any, ...]]],
        take: Callable[[list[Any], slice], bool],
    ) -> None:
        """Run one command per name in pipelined chunks, all within one deadline.

        ``stage(part)`` returns a chunk's commands; ``take(replies, part)`` consumes its replies
        and returns False to stop before the next chunk.
        """
        with self._calling():
            for part in _chunks(len(names), self._chunk):
                if not take(self._run(stage(part), names[part]), part):
                    return

    # -- the contract ---------------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value of ``key`` (``bytes``), or copy it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the value's size (``out`` is left untouched).
        BackendError
            If the server cannot answer within ``deadline_s``.
        """
        dst = None if out is None else as_writable(out)
        name = self._name(key)
        data: bytes | None = self._single(("GET", name), name)
        if data is None or dst is None:
            return data
        if len(data) != dst.nbytes:
            raise BufferSizeError(
                f"output buffer has {dst.nbytes} bytes but the value stored under {key!r} "
                f"has {len(data)}"
            )
        dst[:] = data
        return out

    def exists(self, key: str) -> bool:
        """Return whether ``key`` holds a value."""
        name = self._name(key)
        return bool(self._single(("EXISTS", name), name))

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds one already (the first one wins)."""
        view = as_readable(value)
        name = self._name(key)
        self._single(("SET", name, view, *self._set_args, "NX"), name)
        return True

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        name = self._name(key)
        return bool(self._single(("UNLINK", name), name))

    # -- batches --------------------------------------------------------------------------------

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its buffer, pipelined; a value of another size is a miss."""
        views = [as_writable(out) for out in outs]
        return self._get_many(keys, [[view] for view in views], [view.nbytes for view in views])

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key unless it holds one already, pipelined."""
        return self._set_many(keys, [[as_readable(value)] for value in values])

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist, stopping at the first gap."""
        names = [self._name(key) for key in keys]
        found = 0

        def take(replies: list[Any], part: slice) -> bool:
            nonlocal found
            for reply in replies:
                if not reply:
                    return False
                found += 1
            return True

        self._pipelined(names, lambda part: [("EXISTS", name) for name in names[part]], take)
        return found

    def _get_many(
        self, keys: Sequence[str], targets: Sequence[Sequence[memoryview]], sizes: Sequence[int]
    ) -> list[bool]:
        """GET each key and copy its value into its target buffers when its size matches."""
        names = [self._name(key) for key in keys]
        hits = [False] * len(keys)

        def take(replies: list[Any], part: slice) -> bool:
            for index, data in zip(range(part.start, part.stop), replies, strict=True):
                if data is not None and len(data) == sizes[index]:
                    scatter(data, targets[index])
                    hits[index] = True
            return True

        self._pipelined(names, lambda part: [("GET", name) for name in names[part]], take)
        return hits

    def _set_many(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Set each key to the concatenation of its buffers if absent; one command per key."""
        names = [self._name(key) for key in keys]
        ttl = self._ttl_ms

        def stage(part: slice) -> list[tuple[Any, ...]]:
            commands: list[tuple[Any, ...]] = []
            for name, buffers in zip(names[part], parts[part], strict=True):
                if len(buffers) == 1:
                    commands.append(("SET", name, buffers[0], *self._set_args, "NX"))
                else:
                    commands.append(("EVAL", _SET_PARTS, 1, name, ttl, *buffers))
            return commands

        self._pipelined(names, stage, lambda replies, part: True)
        return [True] * len(keys)

    # -- page I/O against the host pool --------------------------------------------------------

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """GET each key and copy its value straight into its page's buffers (one copy).

        A value whose size differs from its page (the sum of its buffers) is a miss and the page
        is left untouched.
        """
        pages = [[flat(view) for view in views] for views in self.page_views(keys, host_indices)]
        sizes = [sum(view.nbytes for view in views) for views in pages]
        return self._get_many(keys, pages, sizes)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's page, its buffers sent as they are (never joined on this side)."""
        pages = [[flat(view) for view in views] for views in self.page_views(keys, host_indices)]
        return self._set_many(keys, pages)

    # -- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every key of this namespace (SCAN + UNLINK on every primary); nothing else.

        Each round trip (one SCAN step, one UNLINK chunk) is bounded by ``deadline_s``; the
        whole walk takes as long as the keyspace needs.
        """
        pattern = self.config.scan_pattern()
        with self._calling():
            self._nodes.prepare()
            primaries = self._nodes.primaries()
        for node in primaries:
            cursor: Any = 0
            while True:
                with self._calling():
                    scan = ("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
                    reply = self._nodes.run([scan], [node])[0]
                    if isinstance(reply, Exception):
                        raise reply
                cursor, found = int(reply[0]), [name for name in reply[1] if self._owns(name)]
                for part in _chunks(len(found), self._chunk):
                    with self._calling():
                        self._run([("UNLINK", name) for name in found[part]], found[part])
                if cursor == 0:
                    break

    def quota_ledger(self) -> RedisLedger:
        """Return a ledger beside this namespace's pages, on a client of its own."""
        return RedisLedger(connect(self.config, pass_through=False), self.config.namespace)

    def stats(self) -> dict[str, Any]:
        """Return the mode, the servers, round trips made, errors by reason and ``capacity``.

        ``capacity`` is the servers' own (``INFO memory`` and ``stats`` of every primary,
        summed, within ``deadline_s``): Redis evicts on its own under ``maxmemory``, so how full
        it is and what it evicted are the server's figures, shared by every client of it. Where
        the servers do not answer, ``capacity_error`` says why instead.
        """
        with self._lock:
            errors = dict(self._errors)
            round_trips = self._round_trips
        stats: dict[str, Any] = {
            "backend": self.name,
            "mode": "cluster" if self.config.is_cluster else "standalone",
            "servers": self._where,
            "prefix": self.config.namespace,
            "deadline_s": self.config.deadline_s,
            "round_trips": round_trips,
            "errors": errors,
        }
        try:
            stats["capacity"] = self._capacity()
        except HiCacheError as exc:
            stats["capacity_error"] = str(exc)
        return stats

    def _capacity(self) -> Capacity:
        """Sum the primaries' memory, ``maxmemory`` and evicted keys (one round trip each)."""
        with self._calling():
            self._nodes.prepare()
            primaries = self._nodes.primaries()
            commands = [("INFO", section) for _ in primaries for section in ("memory", "stats")]
            nodes = [node for node in primaries for _ in range(2)]
            replies = self._nodes.run(commands, nodes)
        for reply in replies:
            if isinstance(reply, Exception):
                raise BackendUnavailableError(f"redis INFO failed: {reply}")
        info = [_info_fields(reply) for reply in replies]
        memory, counters = info[0::2], info[1::2]
        bounds = [int(fields.get("maxmemory", "0")) for fields in memory]
        return Capacity(
            scope="server",
            used_bytes=sum(int(fields.get("used_memory", "0")) for fields in memory),
            bound_bytes=None if 0 in bounds else sum(bounds),
            evictions=sum(int(fields.get("evicted_keys", "0")) for fields in counters),
            policy=memory[0].get("maxmemory_policy", "") if memory else "",
        )

    def _close(self) -> None:
        self._nodes.close()
