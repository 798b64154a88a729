"""Per-call overhead of the SGLang adapter against calling the same backend directly.

Both sides move the same 128-page batches between the same SGLang host pool (adopted in place) and
the same backend; the adapter adds what SGLang's calls cost: key derivation from bare page hashes,
result conversion and its own bookkeeping. Run with the pinned SGLang installed
(``bash scripts/setup-sglang.sh``)::

    .venv/bin/python scripts/bench_sglang.py --backend memory --backend file

On a machine without torchvision (CPU CI), SGLang's model configs are imported with the test
stand-in from ``tests/sglang/stubs`` (see ``tests/sglang/helpers.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

BATCH = 128
STUBS = Path(__file__).resolve().parent.parent / "tests" / "sglang" / "stubs"


def import_sglang() -> None:
    """Import SGLang's pools, with the torchvision stand-in where no torchvision is installed."""
    from transformers.utils import import_utils

    if not import_utils.is_torchvision_available():
        sys.path.append(str(STUBS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.memory_pool  # noqa: F401


def host_pool(heads: int, page: int, layers: int) -> Any:
    """Build SGLang's MHA host pool (page_first_direct, bf16, head_dim 128) of two batches."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    with host_memory_budget_scope(8 << 30):
        device = MHATokenToKVPool(
            size=page,
            page_size=page,
            dtype=torch.bfloat16,
            head_num=heads,
            head_dim=128,
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
        )
        return MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            page,
            "page_first_direct",
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=page,
            start_layer=0,
            end_layer=layers,
            host_token_capacity=2 * BATCH * page,
        )


def adapter_and_direct(name: str, options: dict[str, Any], pool: Any) -> tuple[Any, Any]:
    """Build the adapter as SGLang does, and the same backend directly on the same pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from hicache_storage import open_backend
    from hicache_storage.integrations.sglang import SGLangStorage, adopt_host_pool

    extra = {
        "backend_name": "hicache",
        "module_path": "hicache_storage.integrations.sglang",
        "class_name": "SGLangStorage",
        "interface_v1": 1,
        "backend": name,
        "options": options,
    }
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="bench/model",
        extra_config=extra,
    )
    adapter = SGLangStorage(cfg, {})
    adapter.register_mem_pool_host(pool)
    direct = open_backend(adapter.config)
    direct.register_host_pool(adopt_host_pool(pool))
    return adapter, direct


def measure(adapter: Any, direct: Any, pool: Any, rounds: int) -> dict[str, list[float]]:
    """Time 128-page calls of both sides on fresh pages each round, in alternating order."""
    from hicache_storage.keys import page_hashes

    scheme = adapter.config.deployment.scheme()
    indices = pool.alloc(BATCH * pool.page_size)
    pool.kv_buffer.view(torch.int16).random_()
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        sides = ("direct", "adapter") if r % 2 == 0 else ("adapter", "direct")
        for side in sides:
            hashes = page_hashes(range(BATCH), 1, prior_hash=page_hashes([r, len(side)], 2)[0])
            if side == "direct":
                keys = scheme.keys(hashes)
                calls = (direct.batch_set_v1, direct.batch_get_v1)
            else:
                keys = hashes
                calls = (adapter.batch_set_v1, adapter.batch_get_v1)
            for op, call in zip(("set", "get"), calls, strict=True):
                start = time.perf_counter()
                done = call(keys, indices)
                times.setdefault(f"{op} {side}", []).append(time.perf_counter() - start)
                assert all(done), f"{side} {op} missed"
    return times


def main() -> None:
    """Print direct and adapter medians and the adapter's overhead per backend and page size."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", action="append", choices=["memory", "file"])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    import_sglang()
    shapes = {"1 KiB": (1, 1, 2), "64 KiB": (1, 16, 8), "2 MiB": (8, 64, 8)}
    print(f"{'backend':8} {'page':7} {'op':4} {'direct ms':>10} {'adapter ms':>11} {'overhead':>9}")
    for name in args.backend or ["memory", "file"]:
        for label, (heads, page, layers) in shapes.items():
            pool = host_pool(heads, page, layers)
            with tempfile.TemporaryDirectory() as root:
                options = {"root": root} if name == "file" else {}
                adapter, direct = adapter_and_direct(name, options, pool)
                times = measure(adapter, direct, pool, args.rounds)
                adapter.close()
                direct.close()
            for op in ("set", "get"):
                d = statistics.median(times[f"{op} direct"])
                a = statistics.median(times[f"{op} adapter"])
                print(
                    f"{name:8} {label:7} {op:4} {d * 1e3:10.2f} {a * 1e3:11.2f}"
                    f" {(a / d - 1) * 100:+8.1f}%"
                )


if __name__ == "__main__":
    main()
