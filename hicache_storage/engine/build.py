"""Build a tier cache for a model shape: its device pool, its host pool and the cache over them.

Every caller that wires an engine by hand (the benchmark, the engine checks of the conformance
suite, the examples, the prefix script) sizes the same two pools from the same facts: the
model's KV shape, a token budget per tier and the page size of the cache's config. One
function does it, so a new pool argument is added once. :func:`check_memory` refuses a shape
whose weights and pools cannot fit the machine before anything is allocated, so an impossible
model is one clear error rather than an allocator's traceback after the setup ran.
"""

from __future__ import annotations

import os

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.errors import ConfigError
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kernels import DevicePool
from hicache_storage.keys import KeyScheme

from .cache import CacheConfig, TierCache
from .model import ModelConfig

__all__ = ["build_cache", "check_memory", "host_memory_bytes", "weight_bytes"]


def weight_bytes(shape: ModelConfig) -> int:
    """Return the bytes of :class:`~hicache_storage.engine.model.LlamaModel`'s weights.

    The embedding and the LM head (``vocab_size x hidden`` each), per layer the fused QKV, output,
    gate-up and down projections and two norms, and the final norm, in ``shape.dtype``.
    """
    c = shape
    attention = (c.heads + 2 * c.kv_heads) * c.head_dim * c.hidden + c.hidden * c.heads * c.head_dim
    per_layer = attention + 3 * c.intermediate * c.hidden + 2 * c.hidden
    return (2 * c.vocab_size * c.hidden + c.layers * per_layer + c.hidden) * c.dtype.itemsize


def host_memory_bytes() -> int:
    """Return the machine's physical memory (``os.sysconf``): the most any host pool can have."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device_memory_bytes(device: torch.device) -> int:
    """Return what a GPU can still give: free memory plus what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


def check_memory(
    shape: ModelConfig,
    device: torch.device | str,
    *,
    device_tokens: int,
    host_tokens: int | None,
    weights: bool = True,
) -> None:
    """Refuse a model whose weights and pools cannot fit the machine, before any is allocated.

    On a GPU the weights (with ``weights``) and the device pool must fit what the GPU can still
    give (free memory, plus what torch's allocator caches unused) and the host pool the host's
    RAM; on a CPU all of them share the host's RAM (``os.sysconf``). Activations are not
    counted, so a shape that passes may still run out; one that fails never fits.

    Raises
    ------
    ConfigError
        One line naming what is needed and what the machine has.
    """
    where = torch.device(device)
    per_token = shape.kv_bytes_per_token
    model = weight_bytes(shape) if weights else 0
    pool = device_tokens * per_token
    host_pool = (host_tokens or 0) * per_token
    on_device = ([f"weights {_gib(model)}"] if weights else []) + [f"device pool {_gib(pool)}"]
    on_host = [f"host pool {_gib(host_pool)}"]
    if where.type == "cuda":
        needs = [
            (model + pool, _device_memory_bytes(where), on_device, str(where)),
            (host_pool, host_memory_bytes(), on_host, "host RAM"),
        ]
    else:
        needs = [(model + pool + host_pool, host_memory_bytes(), on_device + on_host, "RAM")]
    for need, have, what, place in needs:
        if need > have:
            raise ConfigError(
                f"the model does not fit: {_listed(what)} need {_gib(need)} but {place} has "
                f"{_gib(have)}; choose a smaller model, dtype or token budget"
            )


def _listed(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _gib(size: int) -> str:
    return f"{size / (1 << 30):,.1f} GiB"


def build_cache(
    shape: ModelConfig,
    config: CacheConfig,
    *,
    device_tokens: int,
    host_tokens: int | None,
    backend: StorageBackend | None = None,
    device: torch.device | str = "cpu",
    host_layout: str = "layer_first",
    pin_memory: bool | None = None,
    shared_host: bool = False,
    scheme: KeyScheme | None = None,
) -> TierCache:
    """Return a :class:`TierCache` over fresh pools for a model of ``shape``.

    Parameters
    ----------
    shape
        The model whose KV the pools hold (layers, KV heads, head size, dtype).
    config
        The cache's policies; its ``page_size`` is the host pool's page.
    device_tokens, host_tokens
        Each tier's size in tokens; ``host_tokens=None`` builds a cache with no host tier
        (and so no storage tier: ``backend`` must be None).
    backend
        The storage tier (L3), or None.
    device
        Where the device pool lives.
    host_layout
        The host pool's layout (``layer_first``, ``page_first``, ``page_first_direct``).
    pin_memory
        Pin the host pool; by default, when the device is a GPU.
    shared_host
        Allocate the host pool in shared memory (a backend serving from another process).
    scheme
        The key scheme of the storage tier (default: the cache's own).

    Raises
    ------
    ConfigError
        If a backend is given without a host tier, the pools disagree, or they cannot fit the
        machine (:func:`check_memory`).
    """
    where = torch.device(device)
    check_memory(shape, where, device_tokens=device_tokens, host_tokens=host_tokens, weights=False)
    pool = DevicePool.mha(
        device_tokens, shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, where
    )
    host = None
    if host_tokens is not None:
        host = MHAHostPool(
            host_tokens,
            config.page_size,
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
            shape.dtype,
            host_layout,
            where.type == "cuda" if pin_memory is None else pin_memory,
            shared=shared_host,
        )
    return TierCache(pool, host, backend, config, scheme=scheme)
