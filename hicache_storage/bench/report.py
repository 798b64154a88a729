"""What every bench's report shares: how sizes print.

Two forms, for two uses: :func:`format_size` names a size exactly (a page size the user asked
for, a limit), :func:`approx_size` rounds a measured byte count to three figures.
"""

from __future__ import annotations

__all__ = ["approx_size", "format_size"]

_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_size(nbytes: int) -> str:
    """Format a byte count with the largest IEC unit that divides it (``4 MiB``, ``1000 B``)."""
    for unit, scale in _UNITS:
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def approx_size(nbytes: int) -> str:
    """Format a byte count in the largest IEC unit it reaches, to three figures (``1.2 MiB``)."""
    for unit, scale in _UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
