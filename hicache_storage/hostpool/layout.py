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
=====================  ==============================  ==============================

The bytes of one page *object* (what a storage backend stores under one key) depend on the
layout, because each layout keeps a different part of the page contiguous:

=====================  ========================  ==================
layout                 MHA page object           MLA page object
=====================  ========================  ==================
``layer_first``        ``(2, L, page, H, D)``    ``(L, page, d)``
``page_first``         ``(2, page, L, H, D)``    ``(page, L, d)``
``page_first_direct``  ``(2, L, page, H, D)``    ``(L, page, d)``
=====================  ========================  ==================
"""

from __future__ import annotations

import enum

from hicache_storage.errors import HostPoolError

__all__ = [
    "Layout",
    "mha_buffer_shape",
    "mha_page_shape",
    "mla_buffer_shape",
    "mla_page_shape",
]


class Layout(str, enum.Enum):
    """How the host pool tensor orders its (layer, token) axes."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"

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


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HostPoolError(f"{name} must be a positive int, got {value!r}")


def _check_pages(size: int, page_size: int) -> int:
    if size % page_size:
        raise HostPoolError(
            f"size ({size}) must be a multiple of page_size ({page_size}); "
            f"try {size - size % page_size or page_size}"
        )
    return size // page_size


def mha_buffer_shape(
    layout: Layout, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of the MHA pool tensor (K and V stacked on the first axis)."""
    _check_positive(
        size=size, page_size=page_size, layer_num=layer_num, head_num=head_num, head_dim=head_dim
    )
    pages = _check_pages(size, page_size)
    if layout is Layout.LAYER_FIRST:
        return (2, layer_num, size, head_num, head_dim)
    if layout is Layout.PAGE_FIRST:
        return (2, size, layer_num, head_num, head_dim)
    return (2, pages, layer_num, page_size, head_num, head_dim)


def mla_buffer_shape(
    layout: Layout, size: int, page_size: int, layer_num: int, kv_cache_dim: int
) -> tuple[int, ...]:
    """Shape of the MLA pool tensor: the MHA shape with one head and no K/V axis."""
    _check_positive(kv_cache_dim=kv_cache_dim)
    return mha_buffer_shape(layout, size, page_size, layer_num, 1, kv_cache_dim)[1:]


def mha_page_shape(
    layout: Layout, page_size: int, layer_num: int, head_num: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of one MHA page object, whose bytes are what a backend stores per key."""
    _check_positive(page_size=page_size, layer_num=layer_num, head_num=head_num, head_dim=head_dim)
    if layout is Layout.PAGE_FIRST:
        return (2, page_size, layer_num, head_num, head_dim)
    return (2, layer_num, page_size, head_num, head_dim)


def mla_page_shape(
    layout: Layout, page_size: int, layer_num: int, kv_cache_dim: int
) -> tuple[int, ...]:
    """Shape of one MLA page object: the MHA object without the K/V axis and the head axis."""
    _check_positive(kv_cache_dim=kv_cache_dim)
    _, first, second, _, dim = mha_page_shape(layout, page_size, layer_num, 1, kv_cache_dim)
    return (first, second, dim)
