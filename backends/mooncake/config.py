"""Settings of the Mooncake backend, read the way SGLang users already write them.

Each connection setting comes from, in order of precedence: the backend options, a JSON file
(``config_path``, else ``$SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, else ``$MOONCAKE_CONFIG_PATH``)
with SGLang's field names, the ``MOONCAKE_*`` environment variables, and the defaults below.
Sizes are bytes or strings such as ``"4GB"``/``"512MiB"``; like Mooncake and SGLang, every unit
is a power of 1024 (:func:`~hicache_storage.kit.options.bytes_of` with ``units="binary"``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

from hicache_storage.capabilities import Capabilities
from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import MAX_BYTES, bytes_of, check_port, check_seconds
from hicache_storage.redact import redact_url, redacted_repr

__all__ = [
    "capabilities",
    "CONFIG_PATH_ENV",
    "DEFAULT_DEADLINE_S",
    "DEFAULT_GLOBAL_SEGMENT_SIZE",
    "DEFAULT_LOCAL_BUFFER_SIZE",
    "DEFAULT_PROBE_TIMEOUT_S",
    "MIN_DEADLINE_S",
    "MooncakeConfig",
    "MooncakeSettings",
    "normalize_prefix",
    "parse_bytes",
]

CONFIG_PATH_ENV = ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")
"""Environment variables naming a JSON config file, checked in this order."""

DEFAULT_GLOBAL_SEGMENT_SIZE = 0
"""A pure client by default: objects live in long-lived segment holders, never in a segment
that dies with this process (SGLang's default is 4 GiB; see docs/backends/mooncake.md)."""

DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20

DEFAULT_DEADLINE_S = 5.0
"""The longest one call may wait on a silent master."""

MIN_DEADLINE_S = 2.0
"""Shortest ``deadline_s``: the transfer engine's TCP timeouts count whole seconds (at least 1),
and the master's RPCs need a share of the rest (see :mod:`.client`)."""

DEFAULT_PROBE_TIMEOUT_S = 3.0

_PREFIX = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?")
"""Segments of the key alphabet joined by '/', with one trailing '/' allowed."""
_HOST = re.compile(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")

# Setting -> (environment variable, key in a SGLang JSON file).
_SOURCES: dict[str, tuple[str, str]] = {
    "master": ("MOONCAKE_MASTER", "master_server_address"),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "metadata_server"),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "local_hostname"),
    "protocol": ("MOONCAKE_PROTOCOL", "protocol"),
    "device": ("MOONCAKE_DEVICE", "device_name"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", "local_buffer_size"),
}
_DEFAULTS: dict[str, Any] = {
    "metadata_server": "P2PHANDSHAKE",
    "local_hostname": "localhost",
    "protocol": "tcp",
    "device": "",
    "global_segment_size": DEFAULT_GLOBAL_SEGMENT_SIZE,
    "local_buffer_size": DEFAULT_LOCAL_BUFFER_SIZE,
}


def parse_bytes(name: str, value: object) -> int:
    """Read a size (``4294967296``, ``"4GB"``, ``"512 MiB"``, ``"0"``) as bytes.

    Raises
    ------
    ConfigError
        Naming ``name`` when the value is not a whole, non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        number = bytes_of(str(value), units="binary") if isinstance(value, (str, float)) else None
        if number is None:
            raise ConfigError(f"{name} must be a size such as 4294967296 or '4GB', got {value!r}")
        if not math.isfinite(number) or not number.is_integer():
            raise ConfigError(f"{name} must be a whole number of bytes, got {_show(value)}")
        size = int(number)
    if size < 0:
        raise ConfigError(f"{name} must be a non-negative number of bytes, got {value!r}")
    if size > MAX_BYTES:
        raise ConfigError(f"{name} must be at most {MAX_BYTES} bytes (1 PiB), got {_show(value)}")
    return size


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def normalize_prefix(prefix: str) -> str:
    """Return ``prefix`` without its trailing '/', after checking it is a valid namespace.

    A namespace is empty, or segments of the key alphabet (``[A-Za-z0-9_.-]``) joined by
    '/'. Keys never contain '/', so the stored name ``<prefix>/<key>`` tells every namespace
    apart: ``ten`` and ``ten2`` or ``ten/sub`` never share a name.

    Raises
    ------
    ValueError
        If it is not.
    """
    if prefix and not _PREFIX.fullmatch(prefix):
        raise ValueError(
            "prefix must be segments of letters, digits, '_', '.' and '-' joined by '/' "
            f"(one trailing '/' allowed), got {prefix!r}"
        )
    return prefix.removesuffix("/")


def check_address(name: str, value: str, *, port: bool) -> tuple[str, int | None]:
    """Split ``host[:port]`` (``[v6]:port`` for IPv6), checking the port is within 1..65535.

    With ``port`` the port is required.

    Raises
    ------
    ValueError
        If the host is empty or malformed, or the port is missing (when required) or out of
        range.
    """
    text = value.strip()
    host, digits = text, None
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[: close + 1], text[close + 1 :]
        if close < 0 or (rest and not rest.startswith(":")):
            host = ""
        elif rest:
            digits = rest[1:]
    elif text.count(":") == 1 or (port and ":" in text):
        host, _, digits = text.rpartition(":")
    wanted = "host:port" if port else "host or host:port"
    if not host or not _HOST.fullmatch(host) or (port and digits is None):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    try:
        number = None if digits is None else check_port(name, digits)
    except ValueError:
        raise ValueError(
            f"{name} must be {wanted} with a port within 1..65535, got {value!r}"
        ) from None
    return host.strip("[]"), number


def check_metadata_server(name: str, value: str) -> None:
    """Check the port of an ``http(s)://`` or ``etcd://`` metadata server address.

    Raises
    ------
    ValueError
        If a port in it is out of range.
    """
    _, sep, rest = value.partition("://")
    if not sep:
        return  # P2PHANDSHAKE, or a bare etcd host:port list
    for netloc in rest.split("/", 1)[0].split(","):
        netloc = netloc.rpartition("@")[2]
        if netloc:
            check_address(f"{name} ({redact_url(value)})", netloc, port=False)


class MooncakeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of :class:`~hicache_storage.backends.mooncake.MooncakeBackend`.

    Settings left ``None`` are read from the JSON file, then the environment (see the module
    docstring); the variable each one falls back to is given in brackets.

    Attributes
    ----------
    master
        ``host:port`` of ``mooncake_master`` [``MOONCAKE_MASTER``]; required.
    metadata_server
        Transfer-engine metadata: ``P2PHANDSHAKE`` (default), ``http://host:port/metadata`` or
        ``etcd://host:port`` [``MOONCAKE_TE_META_DATA_SERVER``].
    local_hostname
        The address peers reach this process's transfer engine at; default ``localhost``
        [``MOONCAKE_LOCAL_HOSTNAME``].
    protocol
        ``tcp`` (default) or ``rdma`` [``MOONCAKE_PROTOCOL``].
    device
        RDMA device names, comma-separated (``mlx5_0``); empty for TCP [``MOONCAKE_DEVICE``].
    global_segment_size
        Memory this process contributes to the distributed store; default 0 (a pure client:
        the memory comes from long-lived segment holders). Objects in it are dropped when the
        process exits, so with a segment of its own the backend claims neither ``persistent``
        nor ``shared`` [``MOONCAKE_GLOBAL_SEGMENT_SIZE``].
    local_buffer_size
        The registered staging buffer the copying calls (``get``/``set``/``batch_*``) go
        through; the zero-copy v1 calls never use it. Default 16 MiB
        [``MOONCAKE_LOCAL_BUFFER_SIZE``].
    config_path
        A JSON file with SGLang's field names (``master_server_address``, ``metadata_server``,
        ``local_hostname``, ``protocol``, ``device_name``, ``global_segment_size``,
        ``local_buffer_size``); default ``$SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` or
        ``$MOONCAKE_CONFIG_PATH``.
    prefix
        Namespace: segments of ``[A-Za-z0-9_.-]`` joined by '/' (a trailing '/' is dropped).
        Each key is stored as ``<prefix>/<key>`` (just ``<key>`` with no prefix); ``clear()``
        removes only names ``<prefix>/<rest>`` whose ``<rest>`` has no '/'.
    deadline_s
        The longest one call may take while the master does not answer (default 5 s, at least
        2). The client library's master RPC and connect timeouts and its TCP transfer timeouts
        are derived from it, and a call starts no further store request that could not finish
        within what is left of it. A silent segment holder costs a request one transfer timeout
        per wave of transfers to it (docs/backends/mooncake.md, "Failure behaviour").
    probe_timeout_s
        How long the TCP probe of the master (and of an HTTP or etcd metadata server) may take
        before ``setup``: an unreachable master is an error within this time, not Mooncake's
        90-second hang. Default 3 s, or ``deadline_s`` when that is shorter; at most
        ``deadline_s``.
    master_metrics
        ``host:port`` of the master's HTTP metrics (its ``-metrics_port``, 9003 by default).
        Given, ``stats()["capacity"]`` says how full the store is, read from the master: the
        store evicts on its own, so only it knows. None (the default): nothing is read.
    """

    master: str | None = None
    master_metrics: str | None = None
    metadata_server: str | None = None
    local_hostname: str | None = None
    protocol: Literal["tcp", "rdma"] | None = None
    device: str | None = None
    global_segment_size: int | str | None = None
    local_buffer_size: int | str | None = None
    config_path: str | None = None
    prefix: str = ""
    deadline_s: float = DEFAULT_DEADLINE_S
    probe_timeout_s: float | None = None

    def __post_init__(self) -> None:
        normalize_prefix(self.prefix)
        check_seconds("deadline_s", self.deadline_s)
        if self.deadline_s < MIN_DEADLINE_S:
            raise ValueError(
                f"deadline_s must be at least {MIN_DEADLINE_S:g} seconds (the transfer engine's "
                f"TCP timeouts count whole seconds), got {self.deadline_s}"
            )
        check_seconds("probe_timeout_s", self.probe_timeout_s, allow_none=True)
        if self.probe_timeout_s is not None and self.probe_timeout_s > self.deadline_s:
            raise ValueError(
                f"probe_timeout_s={self.probe_timeout_s:g} is longer than "
                f"deadline_s={self.deadline_s:g}: lower it or raise deadline_s"
            )
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if value is not None:
                try:
                    parse_bytes(name, value)
                except ConfigError as exc:
                    raise ValueError(str(exc)) from None
        if self.master is not None:
            check_address("master", self.master, port=True)
        if self.master_metrics is not None:
            check_address("master_metrics", self.master_metrics, port=True)
        if self.local_hostname is not None:
            check_address("local_hostname", self.local_hostname, port=False)
        if self.metadata_server is not None:
            check_metadata_server("metadata_server", self.metadata_server)

    def __repr__(self) -> str:
        return redacted_repr(self)

    def resolve(self, env: Mapping[str, str] | None = None) -> MooncakeSettings:
        """Merge the options, the JSON file and the environment into final settings.

        Raises
        ------
        ConfigError
            If no master address is configured anywhere, the JSON file cannot be read, or a
            value is malformed (the message names the setting and where it came from).
        """
        env = os.environ if env is None else env
        from_file, file_name = self._file(env)
        chosen: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for name, (variable, json_key) in _SOURCES.items():
            option = getattr(self, name)
            if option is not None:
                chosen[name], origin[name] = option, f"option {name!r}"
            elif json_key in from_file and from_file[json_key] not in (None, ""):
                chosen[name], origin[name] = from_file[json_key], f"{json_key!r} in {file_name}"
            elif env.get(variable):
                chosen[name], origin[name] = env[variable], f"${variable}"
            elif name in _DEFAULTS:
                chosen[name], origin[name] = _DEFAULTS[name], "the default"
        master = chosen.get("master")
        if not master:
            raise ConfigError(
                "the mooncake backend needs a master address: set the 'master' option, "
                "'master_server_address' in a config file, or $MOONCAKE_MASTER (host:port)"
            )
        host, port = _host_port(str(master), origin["master"])
        _checked(_check_host, "local_hostname", str(chosen["local_hostname"]), origin)
        _checked(check_metadata_server, "metadata_server", str(chosen["metadata_server"]), origin)
        protocol = str(chosen["protocol"]).lower()
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol from {origin['protocol']} must be 'tcp' or 'rdma'")
        sizes = {
            name: _size(name, chosen[name], origin[name])
            for name in ("global_segment_size", "local_buffer_size")
        }
        return MooncakeSettings(
            master=f"{host}:{port}",
            master_host=host,
            master_port=port,
            metadata_server=str(chosen["metadata_server"]),
            local_hostname=str(chosen["local_hostname"]),
            protocol=protocol,
            device=str(chosen["device"]),
            global_segment_size=sizes["global_segment_size"],
            local_buffer_size=sizes["local_buffer_size"],
            prefix=normalize_prefix(self.prefix),
            deadline_s=float(self.deadline_s),
            probe_timeout_s=float(
                min(DEFAULT_PROBE_TIMEOUT_S, self.deadline_s)
                if self.probe_timeout_s is None
                else self.probe_timeout_s
            ),
        )

    def _file(self, env: Mapping[str, str]) -> tuple[dict[str, Any], str]:
        path = self.config_path or next((env[v] for v in CONFIG_PATH_ENV if env.get(v)), None)
        if not path:
            return {}, ""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the mooncake config file {path!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"the mooncake config file {path!r} must hold a JSON object")
        return data, repr(path)


@dataclasses.dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """Resolved connection settings; equal settings share one store client per process."""

    master: str
    master_host: str
    master_port: int
    metadata_server: str
    local_hostname: str
    protocol: str
    device: str
    global_segment_size: int
    local_buffer_size: int
    prefix: str
    deadline_s: float
    probe_timeout_s: float

    def client_key(self) -> tuple[object, ...]:
        """Return what identifies the store client these settings need.

        The deadline is part of it: the client library reads its RPC timeouts once, at setup.
        """
        return (
            self.master,
            self.metadata_server,
            self.local_hostname,
            self.protocol,
            self.device,
            self.global_segment_size,
            self.local_buffer_size,
            self.deadline_s,
        )

    def __repr__(self) -> str:
        return redacted_repr(self)


def _size(name: str, value: object, origin: str) -> int:
    try:
        return parse_bytes(name, value)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from {origin})") from None


def _host_port(address: str, origin: str) -> tuple[str, int]:
    try:
        host, port = check_address("master", address, port=True)
    except ValueError as exc:
        raise ConfigError(f"master from {origin} must be host:port: {exc}") from None
    assert port is not None
    return host, port


def _check_host(name: str, value: str) -> None:
    check_address(name, value, port=False)


def _checked(
    check: Callable[[str, str], object], name: str, value: str, origin: Mapping[str, str]
) -> None:
    try:
        check(name, value)
    except ValueError as exc:
        raise ConfigError(f"{exc} (from {origin[name]})") from None


def capabilities(global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE) -> Capabilities:
    """Return what a Mooncake backend mounting ``global_segment_size`` bytes promises.

    The registry's record (the default, a pure client) and every instance read this one
    function. Objects may land in any mounted segment, this process's own included, and those
    die with the process (a killed process's segment even keeps taking puts, which fail, until
    the master expires it). So only a pure client (``global_segment_size=0``) promises that data
    outlives the writer (``persistent``) and reaches processes started later (``shared``).
    """
    pure_client = global_segment_size == 0
    return Capabilities(
        persistent=pure_client,
        shared=pure_client,
        native_zero_copy=True,
        delete=True,
        crash_safe_writes=True,
    )
