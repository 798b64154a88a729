"""Two TP2 ranks write a prompt's KV under the unified key scheme; one TP1 rank reads it all.

Run: ``python examples/mixed_tp_fleet.py [ROOT]`` (a temporary directory by default).
The fleet setting that makes this work is ``tp_lcm_size``: the lcm of every TP size sharing the
store (here {1, 2}), the same in every deployment. See docs/keys.md.
"""

from __future__ import annotations

import sys
import tempfile

import torch

from hicache_storage import Deployment, create_backend
from hicache_storage.config import UnifiedKeys
from hicache_storage.hostpool import MHAHostPool, UnifiedObjectPool
from hicache_storage.keys import chain_hashes

LAYERS, HEADS, DIM, PAGE = 4, 8, 64, 16


def deployment(tp_rank: int, tp_size: int) -> Deployment:
    return Deployment(
        model_name="demo-model",
        tp_rank=tp_rank,
        tp_size=tp_size,
        page_size=PAGE,
        key_scheme="unified",
        unified=UnifiedKeys(
            dtype="bf16", num_layers=LAYERS, local_kv_heads=HEADS // tp_size, tp_lcm_size=2
        ),
    )


def pool(heads: int, layout: str) -> MHAHostPool:
    return MHAHostPool(
        size=128,
        page_size=PAGE,
        layer_num=LAYERS,
        head_num=heads,
        head_dim=DIM,
        layout=layout,
        pin_memory=False,
    )


def main(root: str) -> None:
    hashes = chain_hashes(list(range(5000, 5064)), page_size=PAGE)  # four pages
    writers = []
    for rank in range(2):
        dep = deployment(rank, 2)
        host = pool(HEADS // 2, "page_first")
        host.kv_buffer.normal_()
        objects = UnifiedObjectPool(host, dep.unified_plan())
        with create_backend("file", {"root": root}, deployment=dep) as backend:
            backend.register_host_pool(objects)
            indices = host.alloc(len(hashes) * PAGE)
            assert indices is not None
            stored = backend.batch_set_v1(
                dep.unified_plan().keys(hashes), objects.object_indices(indices)
            )
            print(f"TP2 rank {rank} stored {sum(stored)}/{len(stored)} objects")
        writers.append((host, indices))

    dep = deployment(0, 1)
    reader = pool(HEADS, "layer_first")
    plan = dep.unified_plan()
    objects = UnifiedObjectPool(reader, plan)
    with create_backend("file", {"root": root}, deployment=dep) as backend:
        backend.register_host_pool(objects)
        indices = reader.alloc(len(hashes) * PAGE)
        assert indices is not None
        keys = plan.keys(hashes)
        loaded = backend.batch_get_v1(keys, objects.object_indices(indices))
    # K of every layer and token: the reader's 8 heads are the two writers' 4 + 4.
    got = reader.k_buffer[:, indices]
    expected = torch.cat([host.k_buffer[idx].transpose(0, 1) for host, idx in writers], dim=2)
    same = torch.equal(got, expected)
    print(f"TP1 loaded {sum(loaded)}/{len(keys)} objects, identical to the TP2 ranks' KV: {same}")
    if not (all(loaded) and same):
        raise SystemExit("mixed-TP round trip failed")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hicache-fleet-"))
