"""``--set PATH=VALUE`` and ``--settings FILE``: a bench's settings from the command line.

The benches take their sizes and policies by dotted path into their config
(:meth:`BenchConfig.with_settings <hicache_storage.bench.engine.BenchConfig.with_settings>`),
so a setting added to a config needs no option of its own. This reads the paths and values.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..bench.engine import BenchConfig
from ..bench.settings import setting_names
from ..config import read_source
from ..errors import ConfigError

__all__ = ["SET_HELP", "parse_assignment", "read_settings_file"]

SET_HELP = (
    "Set any field of the run by its dotted path (repeatable, in order; over --settings, under "
    "the options above). VALUE is JSON, else a string: write.policy=write_back, "
    "workload.turn_tokens=[256,512], prefetch.timeout.base_s=1. Paths: "
    + setting_names(BenchConfig, inline="cache")
    + "; a wrong one lists the fields there."
)
"""The help of ``--set``: its paths are :class:`BenchConfig`'s fields."""


def parse_assignment(text: str) -> tuple[str, Any]:
    """Return the path and value of one ``--set PATH=VALUE``: the value as JSON, else the text.

    Raises
    ------
    ConfigError
        If ``text`` has no ``=`` or no path.
    """
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set takes PATH=VALUE, got {text!r}")
    try:
        value: Any = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        value = raw
    return path.strip(), value


def read_settings_file(path: str) -> list[tuple[str, Any]]:
    """Return the settings of a JSON or (by its ``.toml`` suffix) TOML file, in order.

    TOML is read by the standard library's ``tomllib`` (Python 3.11) or ``tomli``.

    Raises
    ------
    ConfigError
        If the file cannot be read or parsed, or is not an object.
    """
    if not path.lower().endswith(".toml"):
        return list(read_source(f"@{path}").items())
    try:
        with open(path, "rb") as source:
            data = source.read()
    except OSError as exc:
        raise ConfigError(f"cannot read --settings {path!r}: {exc.strerror or exc}") from None
    try:
        return list(read_source(msgspec.toml.decode(data)).items())
    except ImportError:
        raise ConfigError("--settings in TOML needs Python 3.11 or tomli") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"--settings {path!r} is not TOML: {exc}") from None
