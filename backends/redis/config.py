"""Settings of the Redis backend: where the server is, how to log in, and how long to wait."""

from __future__ import annotations

import math
import re
import urllib.parse

import msgspec

__all__ = ["Endpoint", "RedisConfig", "parse_node", "parse_url"]

_SCHEMES = ("redis", "rediss")
_PREFIX = re.compile(r"[\x21-\x7e]+")
_GLOB = re.compile(r"([*?\[\]\\])")


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One server address and the login details a URL carries."""

    host: str
    port: int
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = None


def _port(text: str, where: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{where} has no valid port (1..65535): {text!r}")
    return int(text)


def parse_url(url: str) -> Endpoint:
    """Read ``redis://[user:password@]host[:port][/db]`` (``rediss://`` for TLS).

    Raises
    ------
    ValueError
        If the scheme, host, port or database number is malformed.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"url must start with redis:// or rediss://, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"url has no valid port (1..65535): {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"url names no host: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"url must not carry a query or fragment; use the options: {url!r}")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"url path must be a database number, got {parts.path!r}")
    unquote = urllib.parse.unquote
    return Endpoint(
        host=parts.hostname,
        port=port or 6379,
        tls=parts.scheme == "rediss",
        db=int(path) if path else 0,
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
    return host, _port(port, f"cluster node {node!r}")


def _seconds(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


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
        Namespace of this backend's keys: every key is stored as ``prefix + key``, and
        ``clear()`` removes only keys under it. Printable ASCII without spaces or braces
        (a ``{hash tag}`` would pin every key to one cluster slot).
    ttl_s
        Expire each object this many seconds after it was written; ``None`` keeps objects until
        deleted or evicted by the server's ``maxmemory`` policy.
    pool_size
        Most connections per server (per node in a cluster); callers beyond it wait up to
        ``socket_timeout_s`` for a free one.
    socket_timeout_s
        Longest wait for the server's answer to one round trip (or for a free connection).
    connect_timeout_s
        Longest wait to open a connection.
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
    prefix: str = "hicache:"
    ttl_s: float | None = None
    pool_size: int = 16
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
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
                f"prefix must be non-empty printable ASCII without spaces, got {self.prefix!r}"
            )
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("prefix must not contain braces: a hash tag pins keys to one slot")
        _seconds("ttl_s", self.ttl_s, allow_none=True)
        _seconds("socket_timeout_s", self.socket_timeout_s)
        _seconds("connect_timeout_s", self.connect_timeout_s)
        for name in ("pool_size", "batch_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_key_file needs tls_cert_file")

    @property
    def is_cluster(self) -> bool:
        """Whether the target is a Redis Cluster."""
        return self.cluster or self.cluster_nodes is not None

    @property
    def uses_tls(self) -> bool:
        """Whether connections use TLS."""
        return self.tls or (self.url is not None and parse_url(self.url).tls)

    @property
    def call_timeout_s(self) -> float:
        """Longest a call waits on an unresponsive server: one connect plus one answer."""
        return self.connect_timeout_s + self.socket_timeout_s

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

    def scan_pattern(self) -> str:
        """Return the SCAN ``MATCH`` pattern of this prefix, glob characters escaped."""
        return _GLOB.sub(r"\\\1", self.prefix) + "*"
