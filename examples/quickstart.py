"""Write a prompt's KV pages to the file backend and load them back into another host pool.

Run: ``python examples/quickstart.py [ROOT]`` (a temporary directory by default).
"""

from __future__ import annotations

import sys
import tempfile

import torch

from hicache_storage import Deployment, create_backend
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.keys import chain_hashes


def main(root: str) -> None:
    deployment = Deployment(model_name="demo-model", tp_rank=0, tp_size=1, page_size=16)
    writer_pool = MHAHostPool(size=256, page_size=16, layer_num=4, head_num=2, head_dim=64)
    reader_pool = MHAHostPool(size=256, page_size=16, layer_num=4, head_num=2, head_dim=64)
    writer_pool.kv_buffer.normal_()

    token_ids = list(range(1000, 1100))  # 100 tokens: six full pages and a partial one
    keys = deployment.rank_suffix().keys(chain_hashes(token_ids[:96], page_size=16))

    with create_backend("file", {"root": root}, deployment=deployment) as writer:
        writer.register_host_pool(writer_pool)
        src = writer_pool.alloc(len(keys) * 16)
        assert src is not None
        print("stored:", writer.batch_set_v1(keys, src))

    with create_backend("file", {"root": root}, deployment=deployment) as reader:
        reader.register_host_pool(reader_pool)
        hit = reader.batch_exists(keys)
        dst = reader_pool.alloc(hit * 16)
        assert dst is not None
        loaded = reader.batch_get_v1(keys[:hit], dst)
        same = all(
            torch.equal(writer_pool.get_data_page(int(s)), reader_pool.get_data_page(int(d)))
            for s, d in zip(src[::16], dst[::16], strict=True)
        )
        print(f"prefix hit: {hit}/{len(keys)} pages, loaded: {all(loaded)}, identical: {same}")
        print("stats:", reader.stats()["metrics"]["ops"]["batch_get_v1"])
        if not (all(loaded) and same and hit == len(keys)):
            raise SystemExit("round trip failed")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hicache-quickstart-"))
