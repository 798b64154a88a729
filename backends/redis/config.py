"""Settings of the Redis backend: where the server is, how to log in, and how long to wait."""

from __future__ import annotations

import re
import urllib.parse

import msgspec

from hicache_storage.capabilities import Capabilities
from hicache_storage.kit.options import MAX_COUNT, MAX_TTL_S, check_count, check_port, check_seconds
from hicache_storage.redact import MASK, redact_url, secrets_in

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "MAX_VALUE_SIZE",
    "Endpoint",
    "RedisConfig",
    "capabilities",
    "parse_node",
    "parse_url",
]

DEFAULT_CONNECT_TIMEOUT_S = 2.0
"""``connect_timeout_s`` when unset (and ``deadline_s`` is longer)."""

_SCHEMES = ("redis", "rediss")
_SEGMENT = r"[A-Za-z0-9_.\-]+"
_PREFIX = re.compile(rf"{_SEGMENT}(?::{_SEGMENT})*:?")
"""Segments of the key alphabet joined by ':' (keys never hold one), a trailing ':' allowed."""
_MAX_DB = (1 << 31) - 1


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One server address and the login details a URL carries."""

    host: str
    port: int
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        password = None if self.password is None else MASK
        return (
            f"Endpoint(host={self.host!r}, port={self.port}, tls={self.tls}, db={self.db}, "
            f"username={self.username!r}, password={password!r})"
        )


def parse_url(url: str) -> Endpoint:
    """Read ``redis://[user:password@]host[:port][/db]`` (``rediss://`` for TLS).

    Raises
    ------
    ValueError
        If the scheme, host, port or database number is malformed. The message never holds
        the URL's password.
    """
    shown = redact_url(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"url must start with redis:// or rediss://, got {shown!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"url has no valid port (1..65535): {shown!r}") from None
    if port is not None:
        check_port("url port", port)
    if not parts.hostname:
        raise ValueError(f"url names no host: {shown!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"url must not carry a query or fragment; use the options: {shown!r}")
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit()):
        raise ValueError(f"url path must be a database number, got {parts.path!r}")
    db = int(path) if path else 0
    check_count("url database number", db, minimum=0, maximum=_MAX_DB)
    unquote = urllib.parse.unquote
    return Endpoint(
        host=parts.hostname,
        port=port or 6379,
        tls=parts.scheme == "rediss",
        db=db,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


def parse_node(node: str) -> tuple[str, int]:
    """Read one cluster node, ``host:port`` or ``[ipv6]:port``.

    Raises
    ------
    ValueError
        If the address has no host or no valid port.
    """
    host, sep, port = node.rpartition(":")
    if not sep or not host:
        raise ValueError(f"cluster node must be host:port, got {node!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, check_port(f"cluster node {node!r}", port)


class RedisConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of :class:`~hicache_storage.backends.redis.RedisBackend`.

    Give exactly one of ``url`` and ``cluster_nodes``.

    Attributes
    ----------
    url
        A standalone server: ``redis://[user:password@]host[:port][/db]``, or ``rediss://`` for
        TLS. With ``cluster=true`` the URL names one node of a Redis Cluster instead.
    cluster_nodes
        Redis Cluster seed nodes as ``"host:port"``; any reachable one lets the client discover
        the others. Implies ``cluster=true``.
    cluster
        Talk to a Redis Cluster (slot routing, no multi-key commands) rather than one server.
    username, password
        ACL user and password; they override those in ``url``. ``None`` sends none.
    tls
        Use TLS (implied by ``rediss://``); needed to enable it for ``cluster_nodes``.
    tls_ca_file
        PEM bundle of the certificate authorities to trust; the system store when ``None``.
    tls_cert_file, tls_key_file
        Client certificate and key (PEM) for servers that require mutual TLS.
    tls_verify
        Verify the server's certificate and host name. Turning it off makes TLS open to
        impersonation; use it only against test servers.
    prefix
        Namespace of this backend's keys: one or more segments of the key alphabet
        (``[A-Za-z0-9_.-]``) joined by ``:``; a trailing ``:`` is dropped. Key ``k`` is stored as
        ``<prefix>:k``, and ``clear()`` removes only names ``<prefix>:<rest>`` whose ``<rest>``
        holds no ``:``, so no two prefixes ever share or clear each other's objects.
    ttl_s
        Expire each object this many seconds after it was written; ``None`` keeps objects until
        deleted or evicted by the server's ``maxmemory`` policy.
    pool_size
        Most connections per server (per node in a cluster); callers beyond it wait for a free
        one, within the call's deadline.
    deadline_s
        Longest any one call (single key or batch, every node and round trip of it, connecting
        and topology refresh included) takes before it raises ``BackendTimeoutError`` or
        ``BackendUnavailableError``.
    socket_timeout_s
        Longest wait for one socket read or write (or for a free pooled connection) within a
        call; at most ``deadline_s``, which it defaults to.
    connect_timeout_s
        Longest wait to open a connection; at most ``deadline_s``. Defaults to 2 s (or
        ``deadline_s`` when shorter).
    batch_chunk_size
        Keys per pipelined round trip in batch calls; bounds the memory one round trip holds.
    """

    url: str | None = None
    cluster_nodes: list[str] | None = None
    cluster: bool = False
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    prefix: str = "hicache"
    ttl_s: float | None = None
    pool_size: int = 16
    deadline_s: float = 5.0
    socket_timeout_s: float | None = None
    connect_timeout_s: float | None = None
    batch_chunk_size: int = 32

    def __post_init__(self) -> None:
        if (self.url is None) == (self.cluster_nodes is None):
            raise ValueError("give exactly one of url and cluster_nodes")
        if self.url is not None:
            endpoint = parse_url(self.url)
            if self.cluster and endpoint.db:
                raise ValueError("a Redis Cluster has only database 0; drop the /db from url")
        if self.cluster_nodes is not None:
            if not self.cluster_nodes:
                raise ValueError("cluster_nodes must name at least one host:port")
            for node in self.cluster_nodes:
                parse_node(node)
        if not isinstance(self.prefix, str) or not _PREFIX.fullmatch(self.prefix):
            raise ValueError(
                "prefix must be one or more segments of letters, digits, '_', '.' and '-' "
                f"joined by ':' (a trailing ':' is allowed), got {self.prefix!r}"
            )
        check_seconds("ttl_s", self.ttl_s, maximum=MAX_TTL_S, allow_none=True)
        check_seconds("deadline_s", self.deadline_s)
        for name in ("socket_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            check_seconds(name, value, allow_none=True)
            if value is not None and value > self.deadline_s:
                raise ValueError(
                    f"{name}={value:g} is longer than deadline_s={self.deadline_s:g}, which "
                    f"bounds every call: lower {name} or raise deadline_s"
                )
        check_count("pool_size", self.pool_size, maximum=MAX_COUNT)
        check_count("batch_chunk_size", self.batch_chunk_size, maximum=MAX_COUNT)
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_key_file needs tls_cert_file")

    def __repr__(self) -> str:
        fields = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name == "password" and value is not None:
                value = MASK
            elif name == "url" and value is not None:
                value = redact_url(value)
            fields.append(f"{name}={value!r}")
        return f"RedisConfig({', '.join(fields)})"

    @property
    def is_cluster(self) -> bool:
        """Whether the target is a Redis Cluster."""
        return self.cluster or self.cluster_nodes is not None

    @property
    def uses_tls(self) -> bool:
        """Whether connections use TLS."""
        return self.tls or (self.url is not None and parse_url(self.url).tls)

    @property
    def namespace(self) -> str:
        """The prefix without its trailing ``:``; key ``k`` is stored as ``<namespace>:k``."""
        return self.prefix[:-1] if self.prefix.endswith(":") else self.prefix

    @property
    def read_timeout_s(self) -> float:
        """The effective ``socket_timeout_s``."""
        return self.deadline_s if self.socket_timeout_s is None else self.socket_timeout_s

    @property
    def open_timeout_s(self) -> float:
        """The effective ``connect_timeout_s``."""
        if self.connect_timeout_s is not None:
            return self.connect_timeout_s
        return min(DEFAULT_CONNECT_TIMEOUT_S, self.deadline_s)

    def endpoints(self) -> list[Endpoint]:
        """Return the configured addresses, with the login options applied."""
        if self.url is not None:
            found = [parse_url(self.url)]
        else:
            found = [
                Endpoint(host=host, port=port)
                for host, port in map(parse_node, self.cluster_nodes or [])
            ]
        return [
            msgspec.structs.replace(
                e,
                tls=e.tls or self.tls,
                username=self.username if self.username is not None else e.username,
                password=self.password if self.password is not None else e.password,
            )
            for e in found
        ]

    def secrets(self) -> set[str]:
        """Return the passwords this config holds (as given and URL-decoded), to mask them."""
        found = {self.password} if self.password else set()
        return found | secrets_in(self.url or "")

    def scan_pattern(self) -> str:
        """Return the SCAN ``MATCH`` pattern of this namespace (no glob character can occur)."""
        return f"{self.namespace}:*"


MAX_VALUE_SIZE = 512 << 20
"""Redis's limit on one string value (``proto-max-bulk-len``'s default)."""


def capabilities(config: RedisConfig | None = None) -> Capabilities:
    """Return what a Redis backend with ``config`` promises; without one, what defaults do.

    The registry's record and every instance read this one function: ``ttl`` only with
    ``ttl_s`` set; first wins because ``SET NX`` runs one command at a time.
    """
    return Capabilities(
        persistent=True,
        shared=True,
        delete=True,
        ttl=config is not None and config.ttl_s is not None,
        crash_safe_writes=True,
        atomic_first_wins=True,
        max_value_size=MAX_VALUE_SIZE,
    )
