"""Turn caller values into flat byte views without copying.

The contract accepts any C-contiguous buffer: ``bytes``, ``bytearray``, ``memoryview``, NumPy
arrays and CPU torch tensors (which do not speak the buffer protocol, so they go through NumPy).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .errors import InvalidValueError

__all__ = ["as_readable", "as_writable", "scatter"]

_FLAT = ("B", 1, True)
"""(format, ndim, c_contiguous) of a view that is already what :func:`as_readable` returns."""


def _torch_view(value: Any) -> memoryview | None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    if value.device.type != "cpu":
        raise InvalidValueError(
            f"a torch tensor on {value.device} cannot be stored directly; copy it to host memory"
        )
    if not value.is_contiguous():
        raise InvalidValueError("a torch tensor value must be contiguous; call .contiguous()")
    flat = value.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def as_readable(value: object) -> memoryview:
    """Return a flat unsigned-byte view of ``value``.

    Raises
    ------
    InvalidValueError
        If ``value`` is not a C-contiguous buffer or a contiguous CPU torch tensor.
    """
    if isinstance(value, (bytes, bytearray)):
        return memoryview(value)
    if isinstance(value, memoryview) and (value.format, value.ndim, value.c_contiguous) == _FLAT:
        return value
    view = _torch_view(value)
    if view is None:
        try:
            view = memoryview(value)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidValueError(
                f"a value must be a C-contiguous buffer (bytes, bytearray, memoryview, numpy "
                f"array or CPU torch tensor), not {type(value).__name__}"
            ) from None
    if not view.c_contiguous:
        raise InvalidValueError("a value must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def as_writable(out: object) -> memoryview:
    """Return a flat unsigned-byte view of the writable buffer ``out``.

    Raises
    ------
    InvalidValueError
        If ``out`` is not a writable C-contiguous buffer.
    """
    view = as_readable(out)
    if view.readonly:
        raise InvalidValueError(
            f"an output buffer must be writable; {type(out).__name__} is read-only"
        )
    return view


def scatter(source: object, views: Sequence[memoryview]) -> None:
    """Copy consecutive slices of ``source`` into the byte ``views``, in order.

    The caller has checked that the views hold exactly ``source``'s bytes.
    """
    data = as_readable(source)
    offset = 0
    for view in views:
        end = offset + view.nbytes
        view[:] = data[offset:end]
        offset = end
