"""Settings of the Mooncake backend, read the way SGLang users already write them.

Each connection setting comes from, in order of precedence: the backend options, a JSON file
(``config_path``, else ``$SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, else ``$MOONCAKE_CONFIG_PATH``)
with SGLang's field names, the ``MOONCAKE_*`` environment variables, and the defaults below.
Sizes are bytes or strings such as ``"4GB"``/``"512MiB"``; like Mooncake and SGLang, every unit
is a power of 1024.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from hicache_storage.errors import ConfigError

__all__ = [
    "CONFIG_PATH_ENV",
    "DEFAULT_GLOBAL_SEGMENT_SIZE",
    "DEFAULT_LOCAL_BUFFER_SIZE",
    "MooncakeConfig",
    "MooncakeSettings",
    "parse_bytes",
]

CONFIG_PATH_ENV = ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")
"""Environment variables naming a JSON config file, checked in this order."""

DEFAULT_GLOBAL_SEGMENT_SIZE = 4 << 30
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_PREFIX = re.compile(r"[A-Za-z0-9._:/@=+-]*")

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
        number = float(value)
    else:
        match = _SIZE.fullmatch(str(value)) if isinstance(value, (str, float)) else None
        if match is None:
            raise ConfigError(f"{name} must be a size such as 4294967296 or '4GB', got {value!r}")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number < 0 or not number.is_integer():
        raise ConfigError(f"{name} must be a whole, non-negative number of bytes, got {value!r}")
    return int(number)


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
        Memory this process contributes to the distributed store; default 4 GiB, 0 for a pure
        client. Objects in it are dropped when the process exits
        [``MOONCAKE_GLOBAL_SEGMENT_SIZE``].
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
        Namespace prepended to every key (letters, digits and ``._:/@=+-``); ``clear()``
        removes only keys under it, and needs it to be non-empty.
    probe_timeout_s
        How long the TCP probe of the master may take before ``setup`` (an unreachable master
        is an error within this time, not Mooncake's 90-second hang), and before each call
        while the master is known to be down.
    """

    master: str | None = None
    metadata_server: str | None = None
    local_hostname: str | None = None
    protocol: Literal["tcp", "rdma"] | None = None
    device: str | None = None
    global_segment_size: int | str | None = None
    local_buffer_size: int | str | None = None
    config_path: str | None = None
    prefix: str = ""
    probe_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(
                f"prefix may hold only letters, digits and '._:/@=+-', got {self.prefix!r}"
            )
        timeout = self.probe_timeout_s
        if isinstance(timeout, bool) or math.isnan(timeout) or not 0 < timeout <= 60:
            raise ValueError(f"probe_timeout_s must be within (0, 60], got {timeout!r}")
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if value is not None:
                try:
                    parse_bytes(name, value)
                except ConfigError as exc:
                    raise ValueError(str(exc)) from None

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
            prefix=self.prefix,
            probe_timeout_s=float(self.probe_timeout_s),
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
    probe_timeout_s: float

    def client_key(self) -> tuple[object, ...]:
        """Return what identifies the store client these settings need."""
        return (
            self.master,
            self.metadata_server,
            self.local_hostname,
            self.protocol,
            self.device,
            self.global_segment_size,
            self.local_buffer_size,
        )


def _size(name: str, value: object, origin: str) -> int:
    try:
        return parse_bytes(name, value)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from {origin})") from None


def _host_port(address: str, origin: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"master from {origin} must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
