"""Real SGLang (the pinned version, installed with ``--no-deps`` by scripts/setup-sglang.sh) on CPU.

Importing SGLang's host pools and controllers runs ``sglang.srt.configs``, which imports
``torchvision`` at module top level for multimodal model configs. The PyPI torchvision wheels are
CUDA builds that fail to load next to the CPU torch (or pull a CUDA torch), so these tests put a
**stand-in** ``torchvision`` package (``tests/sglang/stubs/torchvision``) on the path: it has only
the names those config modules touch at import time and raises on any other use. transformers must
not see it (it would then import ``torchvision.io``), so its cached torchvision probe is taken
first, while the stand-in is not yet visible. Nothing under test uses torchvision.

SGLang's page hash is a C++ extension it builds at first use (g++, ninja, OpenSSL headers).
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

STUBS = Path(__file__).parent / "stubs"
SGLANG_VERSION = "0.5.23"


def _import_sglang() -> None:
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        raise RuntimeError("a real torchvision is installed; these tests expect none")
    if str(STUBS) not in sys.path:
        sys.path.append(str(STUBS))
    with warnings.catch_warnings():
        # SGLang warns at import that AWQ and GGUF need a GPU.
        warnings.simplefilter("ignore")
        import sglang.srt.managers.cache_controller
        import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller  # noqa: F401


_import_sglang()

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

ADAPTER = {
    "backend_name": "hicache",
    "module_path": "hicache_storage.integrations.sglang",
    "class_name": "SGLangStorage",
    "interface_v1": 1,
}
PAGE = 4
DEVICE_TOKENS = 64
TIMEOUT_S = 20
BACKENDS = ("memory", "file", "redis", "s3", "mooncake", "3fs")
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def set_rank(tp_rank: int = 0, tp_size: int = 1) -> None:
    """Publish this process's parallel position, as SGLang's scheduler does at start-up."""
    get_parallel().override_permanently(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )


def storage_config(extra: dict[str, Any], **fields: Any) -> HiCacheStorageConfig:
    """An SGLang storage config as its controller would build it for a single rank."""
    base: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "org/model",
    }
    return HiCacheStorageConfig(**{**base, **fields, "extra_config": extra})


@dataclass
class Pools:
    """A CPU device pool and SGLang's host pool over it."""

    device: Any
    host: Any
    mla: bool


class DeviceAllocator:
    """The part of SGLang's token allocator the storage path reads."""

    def __init__(self, device_pool: Any) -> None:
        self.device_pool = device_pool

    def get_kvcache(self) -> Any:
        return self.device_pool


def make_pools(
    kind: str, layout: str, *, layers: int = 3, dtype: torch.dtype = torch.float16
) -> Pools:
    """Real SGLang pools on CPU (unpinned: pinning needs CUDA)."""
    common = {
        "size": DEVICE_TOKENS,
        "page_size": PAGE,
        "dtype": dtype,
        "layer_num": layers,
        "device": "cpu",
        "enable_memory_saver": False,
    }
    host_args = {
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": DEVICE_TOKENS,
        "start_layer": 0,
        "end_layer": layers,
    }
    with host_memory_budget_scope(1 << 30):
        if kind == "mla":
            device: Any = MLATokenToKVPool(**common, kv_lora_rank=16, qk_rope_head_dim=8)
            info = device.get_device_pool_infos()[0].buffer_info
            host: Any = MLATokenToKVPoolHost(
                info, 2.0, 0, PAGE, layout, **host_args, target_layer_num=layers
            )
        else:
            device = MHATokenToKVPool(**common, head_num=2, head_dim=8)
            info = device.get_device_pool_infos()[0].buffer_info
            host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, **host_args)
    return Pools(device, host, kind == "mla")


def fill_random(host: Any, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Write random pages at ``indices`` through SGLang's own page API; return them."""
    gen = torch.Generator().manual_seed(seed)
    pages = []
    for start in indices[::PAGE].tolist():
        page = host.get_dummy_flat_data_page()
        page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
        host.set_from_flat_data_page(start, page)
        pages.append(page.clone())
    return pages


def read_pages(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(start, flat=True).clone() for start in indices[::PAGE].tolist()]


def controller(
    pools: Pools, extra: dict[str, Any], *, model_name: str = "org/model", backend: str = "dynamic"
) -> Any:
    """SGLang's real HiCacheController with our adapter attached as a dynamic backend.

    ``backend="file"`` attaches SGLang's own ``HiCacheFile`` instead, with ``extra`` as its
    extra config.
    """
    return HiCacheController(
        DeviceAllocator(pools.device),
        pools.host,
        PAGE,
        None,
        threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend=backend,
        model_name=model_name,
        storage_backend_extra_config={**ADAPTER, **extra} if backend == "dynamic" else extra,
        prefetch_threshold=PAGE,
    )


def backup(cc: Any, indices: torch.Tensor, tokens: list[int]) -> int:
    """Back pages up as SGLang's radix tree does; return the tokens the controller acked."""
    hashes = get_hash_str(tokens, None, page_size=PAGE)
    cc.write_storage(indices, tokens, hash_value=hashes, prefix_keys=None)
    return int(cc.ack_backup_queue.get(timeout=TIMEOUT_S).completed_tokens)


def prefetch(cc: Any, host: Any, tokens: list[int], **kwargs: Any) -> tuple[int, torch.Tensor]:
    """Query storage and load the hit into fresh host pages, as the scheduler drives it."""
    # The hybrid controller takes a request handle, the base one a request id.
    handle = SimpleNamespace(rid="req") if isinstance(cc, HybridCacheController) else "req"
    cc.prefetch(handle, tokens, None, **kwargs)
    op = cc.prefetch_hit_queue.get(timeout=TIMEOUT_S)
    hit = int(op.storage_hit_count)
    op.host_indices = host.alloc(hit) if hit else torch.empty(0, dtype=torch.int64)
    cc.prefetch_buffer.put(op)
    loaded = 0
    while not (ack := cc.ack_prefetch_queue.get(timeout=TIMEOUT_S)).completed_req:
        loaded += int(ack.completed_tokens or 0)  # the hybrid controller acks sidecars apart
    return loaded, op.host_indices


def hybrid_controller(kv: Pools, sidecar: Pools, extra: dict[str, Any]) -> Any:
    group = HostPoolGroup(
        [
            PoolEntry(
                PoolName.KV, kv.host, kv.device, lambda layer: layer, is_primary_index_anchor=True
            ),
            PoolEntry(PoolName.INDEXER, sidecar.host, sidecar.device, lambda layer: layer),
        ]
    )
    return HybridCacheController(
        DeviceAllocator(kv.device),
        group,
        PAGE,
        None,
        threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        model_name="org/model",
        storage_backend_extra_config={**ADAPTER, **extra},
        prefetch_threshold=PAGE,
    )


def canonical_mha_page(host: Any, start: int) -> torch.Tensor:
    """The MHA page at ``start`` as ``(2, layers, page, heads, dim)``, whatever the layout."""
    kv, page = host.kv_buffer, start // PAGE
    views = {
        "layer_first": lambda: kv[:, :, start : start + PAGE],
        "page_first": lambda: kv[:, start : start + PAGE].permute(0, 2, 1, 3, 4),
        "page_first_direct": lambda: kv[:, page],
        "page_head": lambda: kv[:, page].permute(0, 3, 2, 1, 4),
    }
    return views[host.layout]().clone()
