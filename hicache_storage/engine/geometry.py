"""Checks that the pools, and a unified plan, describe the same KV before a cache is built on them.

A host pool whose pages would not hold the device pool's KV copies without error and gives the
model wrong KV; a unified plan whose namespace describes other KV names foreign pages. Both are
refused when the :class:`TierCache <hicache_storage.engine.cache.TierCache>` is built, naming
both sides.
"""

from __future__ import annotations

import math

from hicache_storage.errors import ConfigError
from hicache_storage.hostpool import HostKVPool
from hicache_storage.kernels import DevicePool
from hicache_storage.keys import KeySchemeError, UnifiedPlan, logical_dtype

from .errors import PoolMismatchError

__all__ = ["check_plan", "check_pools"]


def _device_geometry(pool: DevicePool, page_size: int) -> str:
    dim = math.prod(pool.row_shape[1:])
    kind = "MLA" if pool.is_mla else f"MHA {pool.row_shape[0]} KV heads x"
    dtype = str(pool.dtype).removeprefix("torch.")
    return f"{kind} {dim} per head, {pool.layer_num} layers, {dtype}, {page_size}-token pages"


def _host_geometry(pool: HostKVPool) -> str:
    mla = pool.is_mla
    dim = getattr(pool, "kv_cache_dim" if mla else "head_dim", None)
    kind = "MLA" if mla else f"MHA {getattr(pool, 'head_num', None)} KV heads x"
    dtype = str(pool.dtype).removeprefix("torch.")
    return f"{kind} {dim} per head, {pool.layer_num} layers, {dtype}, {pool.page_size}-token pages"


def check_pools(device: DevicePool, host: HostKVPool, page_size: int) -> None:
    """Refuse a host pool whose pages would not hold the device pool's KV, naming both sides.

    Equal row bytes are not enough: 4 heads x 8 and 2 heads x 16 copy without error, and a
    layout that orders a page by head (``page_head``) then gives the model wrong KV.
    """
    if _host_geometry(host) != _device_geometry(device, page_size):
        raise PoolMismatchError(
            f"the host pool ({_host_geometry(host)}) does not hold the device pool's KV "
            f"({_device_geometry(device, page_size)}); build both for the model's geometry, "
            f"dtype and the cache's page size"
        )


def check_plan(plan: UnifiedPlan, device: DevicePool, page_size: int) -> None:
    """Refuse a unified plan whose namespace does not describe the device pool's KV."""
    space = plan.namespace
    problems = []
    try:
        dtype = logical_dtype(device.dtype)
    except KeySchemeError as exc:
        problems.append(str(exc))
    else:
        if dtype != space.dtype:
            problems.append(f"dtype {space.dtype} != the pools' {dtype}")
    if space.page_size != page_size:
        problems.append(f"page_size {space.page_size} != the cache's {page_size}")
    layers = (plan.objects[0].layers.start, plan.objects[-1].layers.stop)
    if layers != (0, device.layer_num):
        problems.append(f"layers [{layers[0]}, {layers[1]}) != the model's [0, {device.layer_num})")
    if space.rank_replicated != device.is_mla:
        problems.append("an MLA pool needs an MLA namespace and an MHA pool an MHA one")
    elif not device.is_mla:
        local = max(obj.pool_heads.stop for obj in plan.objects)
        heads = device.row_shape[0]
        if (local, space.total_kv_heads) != (heads, heads):
            problems.append(
                f"{local} local of {space.total_kv_heads} KV heads != the model's {heads}"
            )
    if problems:
        raise ConfigError(
            f"the unified scheme's namespace ({space.model_id!r}) does not describe this "
            f"engine's KV ({_device_geometry(device, page_size)}): " + "; ".join(problems)
        )
