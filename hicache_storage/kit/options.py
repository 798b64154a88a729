"""Checks every backend's config Struct applies to its numeric and address options.

A value that passes here can be handed to a socket, a client library or ``time.sleep`` without a
raw ``OverflowError``/``ValueError`` later: no ``bool`` posing as a number, no NaN, no infinity,
nothing past a bound a real deployment would use. The checks raise ``ValueError``/``TypeError``
from a Struct's ``__post_init__``; :func:`hicache_storage.config.convert` turns those into
:class:`~hicache_storage.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Literal

__all__ = [
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_TIMEOUT_S",
    "MAX_TTL_S",
    "SizeUnits",
    "bytes_of",
    "check_bytes",
    "check_count",
    "check_port",
    "check_seconds",
    "positive_int",
    "share",
]

MAX_TIMEOUT_S = 3600.0
"""Longest timeout or deadline accepted: an hour is already far past any useful cache wait."""

MAX_TTL_S = 10 * 365 * 86400.0
"""Longest time-to-live accepted (ten years)."""

MAX_COUNT = 1 << 20
"""Largest pool size, batch size or thread count accepted."""

MAX_BYTES = 1 << 50
"""Largest byte size accepted (1 PiB)."""

SizeUnits = Literal["si", "binary"]
"""What ``KB``, ``MB``, ``GB``, ``TB`` mean to :func:`bytes_of`: powers of 1000 (``"si"``, the
standard) or of 1024 (``"binary"``, as Mooncake and SGLang read them in their configs)."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|b?)\s*", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def bytes_of(text: str, *, units: SizeUnits) -> float | None:
    """Read a size written as a number and a unit; ``None`` if ``text`` is not one.

    The one unit rule of the project: a bare number or ``B`` is bytes; ``KiB``/``MiB``/... and
    bare letters (``K``, ``M``, ``Ki``, ...) are powers of 1024; ``KB``/``MB``/``GB``/``TB``
    follow ``units``. Case and spaces around the parts are ignored. The result may be
    fractional (``"1.3B"``); callers decide what they accept.
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        return None
    number = float(match.group(1))
    prefix: str | None = match.group(2)
    if prefix is None:
        return number
    letters_only = not match.group(0).strip().lower().endswith("b")
    base = 1024 if match.group(3) or letters_only or units == "binary" else 1000
    scale: int = base ** _POWERS[prefix.lower()]
    return number * scale


def check_seconds(
    name: str,
    value: object,
    *,
    maximum: float = MAX_TIMEOUT_S,
    allow_zero: bool = False,
    allow_none: bool = False,
) -> None:
    """Refuse a duration that is not a finite number of seconds in ``(0, maximum]``.

    Raises
    ------
    TypeError
        If ``value`` is not an int or float (``bool`` included).
    ValueError
        If it is NaN, infinite, negative, zero (unless ``allow_zero``) or above ``maximum``.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    low = ">= 0" if allow_zero else "> 0"
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value}")
    if value < 0 or (value == 0 and not allow_zero) or value > maximum:
        raise ValueError(f"{name} must be {low} and at most {maximum:g} seconds, got {value}")


def check_count(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_COUNT) -> None:
    """Refuse a count that is not an integer within ``[minimum, maximum]``.

    Raises
    ------
    TypeError
        If ``value`` is not an int (``bool`` included).
    ValueError
        If it is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be within [{minimum}, {maximum}], got {value}")


def positive_int(
    name: str,
    value: object,
    error: Callable[[str], Exception] = ValueError,
    *,
    noun: str = "int",
) -> int:
    """Return ``value`` if it is an integer of at least 1; else raise ``error`` naming ``name``.

    The one check behind every count and size of the engine, the host pools and the kit: a
    ``bool`` is not a count, and neither is a float that happens to be whole. ``error`` is the
    exception type the caller's contract names (``ConfigError``, ``HostPoolError``, ...).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name} must be a positive {noun}, got {value!r}")
    return value


def share(name: str, value: object, error: Callable[[str], Exception] = ValueError) -> float:
    """Return ``value`` if it is a number in ``(0, 1]``; else raise ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise error(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_bytes(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_BYTES) -> None:
    """Refuse a byte size that is not an integer within ``[minimum, maximum]``."""
    check_count(name, value, minimum=minimum, maximum=maximum)


def check_port(name: str, value: object) -> int:
    """Return ``value`` as a TCP port (1..65535), accepting an int or a string of digits.

    Raises
    ------
    ValueError
        If it is not a whole number within 1..65535.
    """
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"{name} must be a TCP port within 1..65535, got {value!r}")
    return value
