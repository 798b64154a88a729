"""Our keys are SGLang's: its page hashes, its namespace seeds and ``HiCacheFile``'s file names.

A store is shared with SGLang deployments only if both sides derive the same key for the same page;
each row here compares against SGLang's own code, never against a restatement of it.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str, storage_namespace_seed

from hicache_storage.config import Deployment
from hicache_storage.keys import chain_hashes, namespace_seed, page_hashes
from hicache_storage.kit import MANIFEST_PREFIX

from .helpers import (
    PAGE,
    controller,
    fill_random,
    make_pools,
    read_pages,
    set_rank,
    storage_config,
)

TOKENS = list(range(5, 5 + 3 * PAGE + 1))


@pytest.mark.parametrize(
    ("tokens", "prior"),
    [
        (TOKENS, None),
        (TOKENS, "ab" * 32),
        ([0, 2**32 - 1, 151643, 7, 9], None),
        ([1, 2, 3, 2**32, 5, 6, 7, 8, 9], None),  # the second page is hashed as 8-byte words
        ([2**63 - 1] * PAGE + [1] * PAGE, "cd" * 32),
        ([], None),
    ],
)
def test_page_hashes_equal_sglangs_get_hash_str(tokens: list[int], prior: str | None) -> None:
    assert page_hashes(tokens, PAGE, prior) == get_hash_str(tokens, prior, page_size=PAGE)


def test_an_empty_prior_hash_is_no_prior_on_both_sides() -> None:
    assert page_hashes(TOKENS, PAGE, "") == get_hash_str(TOKENS, "", page_size=PAGE)


@pytest.mark.parametrize(
    ("extra_key", "cache_salt"),
    [
        (None, None),
        ("lora-a", None),
        (None, "tenant"),
        ("", None),
        ("a", "bc"),
        ("ab", "c"),
        (None, ""),
    ],
)
def test_request_namespaces_equal_sglangs(extra_key: str | None, cache_salt: str | None) -> None:
    assert namespace_seed(extra_key, cache_salt) == storage_namespace_seed(extra_key, cache_salt)
    key = RadixKey(array("q", TOKENS), extra_key=extra_key, cache_salt=cache_salt)
    # RadixKey makes cache_salt="" no salt, as SGLang's request parsing does.
    assert chain_hashes(TOKENS, PAGE, extra_key, cache_salt) == get_storage_hash_str(
        key, None, page_size=PAGE
    )


CASES: list[dict[str, Any]] = [
    {"model_name": "Qwen/Qwen3-8B"},
    {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "tp_rank": 1, "tp_size": 2},
    {"model_name": ""},
    {"model_name": None},
    {"model_name": "", "is_mla_model": True},
    {"model_name": "/models/deepseek_v3.1", "is_mla_model": True, "tp_rank": 3, "tp_size": 4},
    {"model_name": "org/m", "pp_rank": 1, "pp_size": 2},
    {"model_name": "org/m", "attn_cp_rank": 1, "attn_cp_size": 2},
    {
        "model_name": "org/m",
        "is_mla_model": True,
        "pp_rank": 0,
        "pp_size": 2,
        "attn_cp_rank": 1,
        "attn_cp_size": 2,
    },
    {"model_name": "a_b-c.d/e_f"},
]


@pytest.mark.parametrize("fields", CASES)
def test_rank_suffix_keys_equal_hicache_file_names(fields: dict[str, Any], tmp_path: Path) -> None:
    cfg = storage_config({"file_storage_path": str(tmp_path)}, **fields)
    theirs = HiCacheFile(cfg)
    ours = Deployment(
        model_name=cfg.model_name or "",
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        pp_rank=cfg.pp_rank,
        pp_size=cfg.pp_size,
        cp_rank=cfg.attn_cp_rank,
        cp_size=cfg.attn_cp_size,
        is_mla=cfg.is_mla_model,
    ).scheme()
    h = page_hashes(TOKENS, PAGE)[0]
    assert ours.keys([h]) == [theirs._get_suffixed_key(h)]


def sglang_file_controller(pools: Any, root: Path) -> Any:
    """SGLang's controller on its own ``file`` backend (``HiCacheFile``)."""
    return controller(pools, {"file_storage_path": str(root)}, backend="file")


def compat_controller(pools: Any, root: Path) -> Any:
    options = {"root": str(root), "naming": "sglang_file_compat"}
    return controller(pools, {"backend": "file", "options": options}, model_name="org/model")


def _write(cc: Any, pools: Any, tokens: list[int], seed: int) -> list[torch.Tensor]:
    src = pools.host.alloc(len(tokens))
    pages = fill_random(pools.host, src, seed)
    cc.write_storage(src, tokens, hash_value=get_hash_str(tokens, None, page_size=PAGE))
    assert cc.ack_backup_queue.get(timeout=20).completed_tokens == len(tokens)
    return pages


def _read(cc: Any, pools: Any, tokens: list[int]) -> list[torch.Tensor]:
    cc.prefetch("req", tokens, None)
    op = cc.prefetch_hit_queue.get(timeout=20)
    assert op.storage_hit_count == len(tokens)
    op.host_indices = pools.host.alloc(len(tokens))
    cc.prefetch_buffer.put(op)
    while not cc.ack_prefetch_queue.get(timeout=20).completed_req:
        pass
    return read_pages(pools.host, op.host_indices)


@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_head"), ("mla", "layer_first")])
def test_a_directory_is_shared_with_sglangs_hicache_file_both_ways(
    kind: str, layout: str, tmp_path: Path
) -> None:
    set_rank()
    first, second = TOKENS[: 2 * PAGE], [*TOKENS[: 2 * PAGE], *range(900, 900 + 2 * PAGE)]

    theirs = make_pools(kind, layout)
    sgl = sglang_file_controller(theirs, tmp_path)
    written_by_sglang = _write(sgl, theirs, first, seed=1)
    sgl.detach_storage_backend()

    ours = make_pools(kind, layout)
    cc = compat_controller(ours, tmp_path)
    assert all(
        torch.equal(a, b) for a, b in zip(_read(cc, ours, first), written_by_sglang, strict=True)
    )
    extended = _write(cc, ours, second, seed=2)  # the shared prefix stays SGLang's bytes
    cc.detach_storage_backend()

    again = make_pools(kind, layout)
    sgl = sglang_file_controller(again, tmp_path)
    got = _read(sgl, again, second)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], written_by_sglang, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got[2:], extended[2:], strict=True))
    sgl.detach_storage_backend()
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(MANIFEST_PREFIX))
    assert all(n.endswith(".bin") for n in names) and len(names) == 4
    manifests = [p.name for p in tmp_path.iterdir() if p.name.startswith(MANIFEST_PREFIX)]
    suffix = "_org-model_0_1" if kind == "mha" else "_org-model"
    assert manifests == [f"{MANIFEST_PREFIX}{suffix}.json"], "ours records the objects' format"
