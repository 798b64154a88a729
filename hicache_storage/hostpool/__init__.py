"""The host KV pool (L2): page allocator, memory layouts and the pools storage backends use."""

from __future__ import annotations

from hicache_storage.hostpool.allocator import PageAllocator, page_ids
from hicache_storage.hostpool.layout import (
    Layout,
    mha_buffer_geometry,
    mha_buffer_shape,
    mha_page_shape,
    mla_buffer_geometry,
    mla_buffer_shape,
    mla_page_shape,
)
from hicache_storage.hostpool.pool import HostKVPool, MHAHostPool, MLAHostPool
from hicache_storage.hostpool.unified import UnifiedObjectPool

__all__ = [
    "HostKVPool",
    "Layout",
    "MHAHostPool",
    "MLAHostPool",
    "PageAllocator",
    "UnifiedObjectPool",
    "mha_buffer_geometry",
    "mha_buffer_shape",
    "mha_page_shape",
    "mla_buffer_geometry",
    "mla_buffer_shape",
    "mla_page_shape",
    "page_ids",
]
