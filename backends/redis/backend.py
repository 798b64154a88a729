"""The Redis backend: one Redis string per key, on a standalone server or a Redis Cluster.

Keys
    Each key is stored as ``prefix + key``. ``clear()`` walks ``SCAN MATCH <prefix>*`` (every
    primary of a cluster) and unlinks what it finds with ``UNLINK``, so it never touches other keys.

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
    Pipelined in chunks of ``batch_chunk_size`` keys: one round trip per chunk (per node in a
    cluster), one single-key command per key, so nothing crosses cluster slots.

Failures
    Every redis-py exception is translated in :func:`_translate`. Client retries are off, and
    each round trip is bounded by ``connect_timeout_s`` + ``socket_timeout_s``, so a call against
    a stopped server fails at once (connection refused) and against a hung one within the
    timeouts; the default layers turn either into a miss.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

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
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE
from typing_extensions import Buffer

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import Deployment
from hicache_storage.errors import (
    BackendClosedError,
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    BufferSizeError,
    ConfigError,
)

from .config import RedisConfig

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_VALUE_SIZE", "RedisBackend", "connect"]


MAX_VALUE_SIZE = 512 << 20
"""Largest value Redis accepts by default (``proto-max-bulk-len``)."""

_SCAN_COUNT = 1000
_READ_SIZE = 1 << 18
"""Socket read size: large values arrive in fewer ``recv`` calls than redis-py's 64 KiB."""
_T = TypeVar("_T")

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


class _PassThroughPacker:
    """Hand memoryview arguments to ``sendall`` untouched; pack everything else with hiredis.

    redis-py's default (hiredis) packer copies every memoryview into ``bytes`` and then the
    whole command into one more buffer; its pure-Python packer passes memoryviews through but
    packs small commands several times slower. A value is always a memoryview here, so a
    command that carries one takes the Python path and every other one (GET, EXISTS) hiredis.
    """

    def __init__(self, buffer_cutoff: int, encode: Callable[[Any], Any]) -> None:
        self._python = PythonRespSerializer(buffer_cutoff, encode)
        self._fast: Any = HiredisRespSerializer() if HIREDIS_AVAILABLE else self._python

    def pack(self, *args: Any) -> Any:
        for arg in args:
            if isinstance(arg, memoryview):
                return self._python.pack(*args)  # type: ignore[no-untyped-call]
        return self._fast.pack(*args)


def _connection_class(config: RedisConfig, *, pass_through: bool) -> type[AbstractConnection]:
    """Return the connection class for ``config``, with its TLS settings baked in.

    With ``pass_through``, values go to the socket as they are (see :class:`_PassThroughPacker`).
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

    return ConfiguredConnection


def connect(config: RedisConfig, *, pass_through: bool = True) -> Any:
    """Build the redis-py client ``config`` describes, with client retries off.

    A standalone client does no I/O yet; a cluster client contacts a seed node at once to learn
    the slot map. ``pass_through=False`` keeps redis-py's default packer (what the raw baseline
    measures).
    """
    endpoints = config.endpoints()
    first = endpoints[0]
    common: dict[str, Any] = {
        "username": first.username,
        "password": first.password,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_read_size": _READ_SIZE if pass_through else 65536,
        "connection_class": _connection_class(config, pass_through=pass_through),
    }
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
            timeout=config.socket_timeout_s,
            **common,
        )
    pool = BlockingConnectionPool(  # type: ignore[no-untyped-call]
        max_connections=config.pool_size,
        timeout=config.socket_timeout_s,
        host=first.host,
        port=first.port,
        db=first.db,
        retry=no_retry,
        **common,
    )
    return redis.Redis(connection_pool=pool)


def _where(config: RedisConfig) -> str:
    kind = "cluster " if config.is_cluster else ""
    nodes = ",".join(f"{e.host}:{e.port}" for e in config.endpoints())
    return f"redis {kind}{nodes}"


def _translate(exc: Exception, where: str, config: RedisConfig) -> tuple[str, BackendError]:
    """Map a redis-py exception to ``(reason, typed error)``; the one place that does."""
    cause = exc.__cause__
    if isinstance(exc, rx.RedisClusterException) and isinstance(cause, rx.RedisError):
        exc = cause  # "cluster cannot be connected" wraps the reason the nodes gave
    error: BackendError
    if isinstance(exc, rx.AuthenticationError):
        error = BackendUnavailableError(f"{where} refused the login (username/password): {exc}")
        error.retryable = False
        return "auth", error
    if isinstance(exc, rx.TimeoutError):
        seconds = config.call_timeout_s
        return "timeout", BackendTimeoutError(f"{where} did not answer within {seconds:g}s: {exc}")
    if isinstance(exc, rx.ConnectionError | rx.ClusterDownError | rx.RedisClusterException):
        return "unavailable", BackendUnavailableError(f"{where} is unavailable: {exc}")
    if isinstance(exc, rx.ReadOnlyError | rx.TryAgainError):
        return "unavailable", BackendUnavailableError(f"{where} cannot take writes now: {exc}")
    if isinstance(exc, rx.OutOfMemoryError) or str(exc).startswith("OOM"):
        error = BackendIOError(f"{where} is full (maxmemory with a noeviction policy): {exc}")
        return "out_of_memory", error
    return "error", BackendIOError(f"{where} failed: {type(exc).__name__}: {exc}")


def _chunks(count: int, size: int) -> Iterator[slice]:
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def _flat(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _scatter(data: bytes, views: Sequence[memoryview]) -> None:
    """Copy consecutive slices of ``data`` into ``views`` (sizes already checked)."""
    source = memoryview(data)
    offset = 0
    for view in views:
        end = offset + view.nbytes
        view[:] = source[offset:end]
        offset = end


class RedisBackend(StorageBackend):
    """Stores each key as one Redis string under ``config.prefix``; see the module docstring.

    Construction checks the server with a ``PING`` (a cluster client also loads the slot map).

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
        If no server answers within ``connect_timeout_s`` + ``socket_timeout_s``.
    """

    name = "redis"

    def __init__(self, config: RedisConfig, deployment: Deployment | None = None) -> None:
        super().__init__()
        self.config = config
        self.deployment = deployment if deployment is not None else Deployment()
        self.capabilities = Capabilities(
            persistent=True,
            shared=True,
            delete=True,
            ttl=config.ttl_s is not None,
            crash_safe_writes=True,
            max_value_size=MAX_VALUE_SIZE,
        )
        self._where = _where(config)
        self._prefix = config.prefix.encode("ascii")
        self._chunk = config.batch_chunk_size
        self._ttl_ms = 0 if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._set_args: tuple[Any, ...] = () if not self._ttl_ms else ("PX", self._ttl_ms)
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._round_trips = 0
        self._client: Any = None
        try:
            self._client = connect(config)
            self._client.ping()
        except (rx.RedisError, rx.RedisClusterException) as exc:
            self._close_client()
            raise self._open_error(exc) from exc

    def _open_error(self, exc: Exception) -> Exception:
        reason, error = _translate(exc, self._where, self.config)
        if reason == "auth":
            return ConfigError(
                f"{self._where} refused the login: check username and password ({exc})"
            )
        if reason in ("unavailable", "timeout"):
            return BackendUnavailableError(
                f"cannot reach {self._where} within connect_timeout_s="
                f"{self.config.connect_timeout_s:g}s / socket_timeout_s="
                f"{self.config.socket_timeout_s:g}s: {exc}"
            )
        return error

    # -- plumbing -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("the redis backend is closed; create a new one")

    def _name(self, key: str) -> bytes:
        return self._prefix + key.encode("ascii")

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Translate redis-py exceptions into typed errors, counting them by reason."""
        try:
            yield
        except (rx.RedisError, rx.RedisClusterException) as exc:
            reason, error = _translate(exc, self._where, self.config)
            with self._lock:
                self._errors[reason] += 1
            raise error from exc

    def _pipelined(
        self,
        count: int,
        stage: Callable[[Any, slice], None],
        take: Callable[[list[Any], slice], bool],
    ) -> None:
        """Run ``count`` commands in pipelined chunks.

        ``stage(pipe, part)`` queues a chunk's commands; ``take(replies, part)`` consumes its
        replies and returns False to stop before the next chunk.
        """
        for part in _chunks(count, self._chunk):
            with self._calling():
                pipe = self._client.pipeline(transaction=False)
                stage(pipe, part)
                replies = pipe.execute()
            with self._lock:
                self._round_trips += 1
            if not take(replies, part):
                return

    def _single(self, call: Callable[[], _T]) -> _T:
        with self._calling():
            result = call()
        with self._lock:
            self._round_trips += 1
        return result

    # -- the contract ---------------------------------------------------------------------------

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        """Return the value of ``key`` (``bytes``), or copy it into ``out``; None on a miss.

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the value's size (``out`` is left untouched).
        BackendError
            If the server cannot answer.
        """
        self._check_open()
        dst = None if out is None else as_writable(out)
        data: bytes | None = self._single(lambda: self._client.get(self._name(key)))
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
        self._check_open()
        return bool(self._single(lambda: self._client.exists(self._name(key))))

    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key`` unless it holds one already (the first one wins)."""
        self._check_open()
        view = as_readable(value)
        self._single(
            lambda: self._client.execute_command(
                "SET", self._name(key), view, *self._set_args, "NX"
            )
        )
        return True

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        self._check_open()
        return bool(self._single(lambda: self._client.unlink(self._name(key))))

    # -- batches --------------------------------------------------------------------------------

    def batch_get(self, keys: Sequence[str], outs: Sequence[Buffer]) -> list[bool]:
        """Read each key into its buffer, pipelined; a value of another size is a miss."""
        self._check_open()
        views = [as_writable(out) for out in outs]
        return self._get_many(keys, [[view] for view in views], [view.nbytes for view in views])

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key unless it holds one already, pipelined."""
        self._check_open()
        return self._set_many(keys, [[as_readable(value)] for value in values])

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Return the length of the leading run of keys that exist, stopping at the first gap."""
        self._check_open()
        found = 0

        def stage(pipe: Any, part: slice) -> None:
            for key in keys[part]:
                pipe.exists(self._name(key))

        def take(replies: list[Any], part: slice) -> bool:
            nonlocal found
            for reply in replies:
                if not reply:
                    return False
                found += 1
            return True

        self._pipelined(len(keys), stage, take)
        return found

    def _get_many(
        self, keys: Sequence[str], targets: Sequence[Sequence[memoryview]], sizes: Sequence[int]
    ) -> list[bool]:
        """GET each key and copy its value into its target buffers when its size matches."""
        hits = [False] * len(keys)

        def stage(pipe: Any, part: slice) -> None:
            for key in keys[part]:
                pipe.get(self._name(key))

        def take(replies: list[Any], part: slice) -> bool:
            for index, data in zip(range(part.start, part.stop), replies, strict=True):
                if data is not None and len(data) == sizes[index]:
                    _scatter(data, targets[index])
                    hits[index] = True
            return True

        self._pipelined(len(keys), stage, take)
        return hits

    def _set_many(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Set each key to the concatenation of its buffers if absent; one command per key."""
        ttl = self._ttl_ms

        def stage(pipe: Any, part: slice) -> None:
            for key, buffers in zip(keys[part], parts[part], strict=True):
                name = self._name(key)
                if len(buffers) == 1:
                    pipe.execute_command("SET", name, buffers[0], *self._set_args, "NX")
                else:
                    pipe.execute_command("EVAL", _SET_PARTS, 1, name, ttl, *buffers)

        self._pipelined(len(keys), stage, lambda replies, part: True)
        return [True] * len(keys)

    # -- page I/O against the host pool --------------------------------------------------------

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """GET each key and copy its value straight into its page's buffers (one copy).

        A value whose size differs from its page (the sum of its buffers) is a miss and the page
        is left untouched.
        """
        self._check_open()
        pages = [[_flat(view) for view in views] for views in self.page_views(keys, host_indices)]
        sizes = [sum(view.nbytes for view in views) for views in pages]
        return self._get_many(keys, pages, sizes)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        """Store each key's page, its buffers sent as they are (never joined on this side)."""
        self._check_open()
        pages = [[_flat(view) for view in views] for views in self.page_views(keys, host_indices)]
        return self._set_many(keys, pages)

    # -- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every key under this backend's prefix (SCAN + UNLINK); nothing else."""
        self._check_open()
        pattern = self.config.scan_pattern()
        found: list[bytes] = []
        with self._calling():
            for name in self._client.scan_iter(match=pattern, count=_SCAN_COUNT):
                if name.startswith(self._prefix):
                    found.append(name)
                if len(found) >= _SCAN_COUNT:
                    self._unlink(found)
                    found = []
        self._unlink(found)

    def _unlink(self, names: list[bytes]) -> None:
        def stage(pipe: Any, part: slice) -> None:
            for name in names[part]:
                pipe.unlink(name)

        self._pipelined(len(names), stage, lambda replies, part: True)

    def stats(self) -> dict[str, Any]:
        """Return the mode, the servers, round trips made and errors by reason."""
        with self._lock:
            errors = dict(self._errors)
            round_trips = self._round_trips
        return {
            "backend": self.name,
            "mode": "cluster" if self.config.is_cluster else "standalone",
            "servers": self._where,
            "prefix": self.config.prefix,
            "round_trips": round_trips,
            "errors": errors,
        }

    def _close(self) -> None:
        self._close_client()

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        with contextlib.suppress(rx.RedisError, rx.RedisClusterException, OSError):
            client.close()
            if not self.config.is_cluster:
                client.connection_pool.disconnect()
