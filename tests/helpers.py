"""Helpers shared by the project's tests."""

from __future__ import annotations

import torch

from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def make_pool(kind: str, layout: str, pages: int = 8, page_size: int = 4) -> HostKVPool:
    if kind == "mha":
        return MHAHostPool(
            size=pages * page_size,
            page_size=page_size,
            layer_num=3,
            head_num=2,
            head_dim=8,
            dtype=torch.bfloat16,
            layout=layout,
            pin_memory=False,
        )
    return MLAHostPool(
        size=pages * page_size,
        page_size=page_size,
        layer_num=3,
        kv_cache_dim=24,
        dtype=torch.bfloat16,
        layout=layout,
        pin_memory=False,
    )
