"""Logical views of host pools: read and write KV by (K/V, layer, token, head) in any layout."""

from __future__ import annotations

import torch

from hicache_storage.hostpool import HostKVPool, Layout


def page_view(pool: HostKVPool, page: int) -> torch.Tensor:
    """The pool's page as a writable view: MHA ``(2, L, page, H, D)``, MLA ``(L, page, 1, d)``."""
    kv, ps = pool.kv_buffer, pool.page_size
    s = page * ps
    if pool.is_mla:
        if pool.layout is Layout.LAYER_FIRST:
            return kv[:, s : s + ps]
        if pool.layout is Layout.PAGE_FIRST:
            return kv[s : s + ps].transpose(0, 1)
        return kv[page]
    if pool.layout is Layout.LAYER_FIRST:
        return kv[:, :, s : s + ps]
    if pool.layout is Layout.PAGE_FIRST:
        return kv[:, s : s + ps].transpose(1, 2)
    return kv[:, page]


def fill_pages(pool: HostKVPool, pages: list[int], kv: torch.Tensor) -> None:
    """Write logical KV (``(2, L, tokens, H, D)`` or ``(L, tokens, 1, d)``) into pool pages."""
    ps = pool.page_size
    for i, page in enumerate(pages):
        tokens = slice(i * ps, (i + 1) * ps)
        page_view(pool, page).copy_(kv[..., tokens, :, :])


def read_pages(pool: HostKVPool, pages: list[int]) -> torch.Tensor:
    """Read pool pages back as logical KV (the inverse of :func:`fill_pages`)."""
    return torch.cat([page_view(pool, page) for page in pages], dim=-3)
