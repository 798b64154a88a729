"""Memory layouts of the host KV pool and the shape math that follows from them.

A pool holds ``size`` token slots grouped into pages of ``page_size`` tokens, for ``L`` layers.
MHA pools store ``H`` heads of ``D`` elements for both K and V; MLA pools store one latent
vector of ``d`` (``kv_cache_dim``) elements per token and layer, kept as a single "head".

=====================  ==============================  ==============================
layout                 MHA pool tensor                 MLA pool tensor
=====================  ==============================  ==============================
``layer_first``        ``(2, L, size, H, D)``          ``(L, size, 1, d)``
``page_first``         ``(2, size, L, H, D)``          ``(size, L, 1, d)``
``page_first_direct``  ``(2, pages, L, page, H, D)``   ``(pages, L, page, 1, d)``
``page_head``          ``(2, pages, H, page, L, D)``   (MHA only)
=====================  ==============================  ==============================

The bytes of one page *object* (what a storage backend stores under one key) depend on the
layout, because each layout keeps a different part of the page contiguous:

=====================  ========================  ==================
layout                 MHA page object           MLA page object
=====================  ========================  ==================
``layer_first``        ``(2, L, page, H, D)``    ``(L, page, d)``
``page_first``         ``(2, page, L, H, D)``    ``(page, L, d)``
``page_first_direct``  ``(2, L, page, H, D)``    ``(L, page, d)``
``page_head``          ``(2, H, page, L, D)``    (MHA only)
=====================  ========================  ==================

All four are the layouts of SGLang's host pools (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``), with the same tensors and the same page objects.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from hicache_storage.errors import HostPoolError
from hicache_storage.kit.options import positive_int

__all__ = [
    "Layout",
    "mha_buffer_geometry",
    "mha_buffer_shape",
    "mha_page_shape",
    "mla_buffer_geometry",
    "mla_buffer_shape",
    "mla_page_shape",
]


class Layout(str, enum.Enum):
    """How the host pool tensor orders its (layer, token, head) axes."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"
    """MHA only: each page holds, per head, its tokens' rows of every layer."""

    @classmethod
    def parse(cls, value: Layout | str) -> Layout:
        """Return the layout named by ``value`` (case-insensitive); raise HostPoolError if none."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        valid = ", ".join(repr(member.value) for member in cls)
        raise HostPoolError(f"unknown host pool layout {value!r}; valid layouts are {valid}")


# Axes of the MHA pool tensor, outermost first: "kv" (K then V), "layer", "token" (a slot),
# "page", "offset" (a slot's place in its page), "head" and "dim". An MLA pool tensor is the
# MHA one without the "kv" axis and with one head.
_MHA_AXES: dict[Layout, tuple[str, ...]] = {
    Layout.LAYER_FIRST: ("kv", "layer", "token", "head", "dim"),
    Layout.PAGE_FIRST: ("kv", "token", "layer", "head", "dim"),
    Layout.PAGE_FIRST_DIRECT: ("kv", "page", "layer", "offset", "head", "dim"),
    Layout.PAGE_HEAD: ("kv", "page", "head", "offset", "layer", "dim"),
}
_SYMBOLS = {
    "kv": "2",
    "layer": "L",
    "token": "size",
    "page": "pages",
    "offset": "page",
    "head": "H",
    "dim": "D",
}


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        positive_int(name, value, HostPoolError)


def _check_pages(size: int, page_size: int) -> int:
    if size % page_size:
        raise HostPoolError(
            f"size ({size}) must be a multiple of page_size ({page_size}); "
            f"try {size - size % page_size or page_size}"
        )
    return size // page_size


def _mla_axes(layout: Layout) -> tuple[str, ...]:
    if layout is Layout.PAGE_HEAD:
        raise HostPoolError(
            "page_head is MHA-only: an MLA pool has one latent vector per token and no heads "
            "to group; use layer_first, page_first or page_first_direct"
        )
    return _MHA_AXES[layout][1:]


def mha_buffer_shape(
    layout: Layout, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of the MHA pool tensor (K and V stacked on the first axis)."""
    _check_positive(
        size=size, page_size=page_size, layer_num=layer_num, head_num=head_num, head_dim=head_dim
    )
    lengths = {
        "kv": 2,
        "layer": layer_num,
        "token": size,
        "page": _check_pages(size, page_size),
        "offset": page_size,
        "head": head_num,
        "dim": head_dim,
    }
    return tuple(lengths[axis] for axis in _MHA_AXES[layout])


def mla_buffer_shape(
    layout: Layout, size: int, page_size: int, layer_num: int, kv_cache_dim: int
) -> tuple[int, ...]:
    """Shape of the MLA pool tensor: the MHA shape with one head and no K/V axis.

    Raises
    ------
    HostPoolError
        If ``layout`` is ``page_head`` (MHA only) or a count is not positive.
    """
    _mla_axes(layout)
    _check_positive(kv_cache_dim=kv_cache_dim)
    return mha_buffer_shape(layout, size, page_size, layer_num, 1, kv_cache_dim)[1:]


def mha_page_shape(
    layout: Layout, page_size: int, layer_num: int, head_num: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of one MHA page object, whose bytes are what a backend stores per key."""
    _check_positive(page_size=page_size, layer_num=layer_num, head_num=head_num, head_dim=head_dim)
    # A page is the pool tensor without its page axis, cut to page_size slots.
    lengths = {
        "kv": 2,
        "layer": layer_num,
        "token": page_size,
        "offset": page_size,
        "head": head_num,
        "dim": head_dim,
    }
    return tuple(lengths[axis] for axis in _MHA_AXES[layout] if axis != "page")


def mla_page_shape(
    layout: Layout, page_size: int, layer_num: int, kv_cache_dim: int
) -> tuple[int, ...]:
    """Shape of one MLA page object: the MHA object without the K/V axis and the head axis.

    Raises
    ------
    HostPoolError
        If ``layout`` is ``page_head`` (MHA only) or a count is not positive.
    """
    _mla_axes(layout)
    _check_positive(kv_cache_dim=kv_cache_dim)
    _, first, second, _, dim = mha_page_shape(layout, page_size, layer_num, 1, kv_cache_dim)
    return (first, second, dim)


def _axis_lengths(
    kind: str, layout: Layout, axes: tuple[str, ...], shape: Sequence[int], page_size: int
) -> dict[str, int]:
    """Read the length of every axis of a pool tensor of ``shape``, and its slot count."""
    symbols = {**_SYMBOLS, "head": "1", "dim": "d"} if kind == "MLA" else _SYMBOLS
    expected = "(" + ", ".join(symbols[axis] for axis in axes) + ")"

    def refuse(problem: str) -> HostPoolError:
        return HostPoolError(
            f"a tensor of shape {tuple(shape)} is not an {kind} {layout.value} pool "
            f"{expected} with page_size {page_size}: {problem}"
        )

    _check_positive(page_size=page_size)
    if len(shape) != len(axes):
        raise refuse(f"it has {len(shape)} dimensions, the layout has {len(axes)}")
    lengths = dict(zip(axes, (int(n) for n in shape), strict=True))
    if min(lengths.values()) <= 0:
        raise refuse("every axis must be non-empty")
    if lengths.get("kv", 2) != 2:
        raise refuse(f"the K/V axis has length {lengths['kv']}, not 2")
    if lengths.get("offset", page_size) != page_size:
        raise refuse(f"the in-page axis has length {lengths['offset']}, not page_size")
    if kind == "MLA" and lengths["head"] != 1:
        raise refuse(f"the head axis has length {lengths['head']}, not 1")
    size = lengths["token"] if "token" in lengths else lengths["page"] * page_size
    if size % page_size:
        raise refuse(f"its {size} token slots are not a whole number of pages")
    lengths["token"] = size
    return lengths


def mha_buffer_geometry(
    layout: Layout, shape: Sequence[int], page_size: int
) -> tuple[int, int, int, int]:
    """Read ``(size, layer_num, head_num, head_dim)`` off the shape of an MHA pool tensor.

    The inverse of :func:`mha_buffer_shape`.

    Raises
    ------
    HostPoolError
        If ``shape`` is not the shape of an MHA pool tensor of ``layout`` with pages of
        ``page_size`` tokens; the message names the layout and the problem.
    """
    lengths = _axis_lengths("MHA", layout, _MHA_AXES[layout], shape, page_size)
    return lengths["token"], lengths["layer"], lengths["head"], lengths["dim"]


def mla_buffer_geometry(
    layout: Layout, shape: Sequence[int], page_size: int
) -> tuple[int, int, int]:
    """Read ``(size, layer_num, kv_cache_dim)`` off the shape of an MLA pool tensor.

    The inverse of :func:`mla_buffer_shape`.

    Raises
    ------
    HostPoolError
        If ``layout`` is ``page_head`` (MHA only), or ``shape`` is not the shape of an MLA pool
        tensor of ``layout`` with pages of ``page_size`` tokens.
    """
    lengths = _axis_lengths("MLA", layout, _mla_axes(layout), shape, page_size)
    return lengths["token"], lengths["layer"], lengths["dim"]
