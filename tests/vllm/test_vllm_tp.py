"""Tensor parallelism on CPU (gloo): every rank's bytes stored and found."""

from __future__ import annotations

from pathlib import Path

from hicache_storage.integrations.vllm import harness

from .conftest import ENV, tokens

PROMPTS = harness.prompts(2, 200, 40, seed=6)


def test_tp2_is_served_from_storage(model: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = harness.kv_transfer_config({"backend": "file", "options": {"root": str(store)}})
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    process = harness.run_detached(
        model, [None, config, config], PROMPTS, env=env, tensor_parallel_size=2
    )
    alone, cold, warm = harness.detached_result(process)
    assert tokens(cold) == tokens(alone)  # TP=2 output, compared with TP=2 without the tier
    assert [g.cached_tokens for g in warm] == [224, 224]
    assert tokens(warm) == tokens(alone)
    # A chunk holds both ranks' halves of the KV heads: 2 x 32 KiB of bf16 per 32-token block.
    sizes = {p.stat().st_size for p in store.rglob("vllm-*") if p.is_file()}
    assert sizes == {2 * 32 * 1024 + 32}, sizes  # + the 32-byte integrity record
