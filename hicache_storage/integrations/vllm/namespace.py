"""What the bytes of one vLLM offload chunk mean, and the store keys derived from it.

A chunk is a row of vLLM's CPU primary tier: every worker's bytes of ``blocks_per_chunk``
consecutive KV blocks, in vLLM's own layout. Those bytes are only meaningful to a reader that
agrees on every fact of :class:`ChunkFormat`: the model (its weights, sampled, and every config
setting that shapes its KV, :func:`~hicache_storage.keys.identity.model_identity`, not its path)
and dtypes, the block geometry, the parallel layout that split the heads, the KV cache layout
and (on CPU) the attention kernel's byte order, and the block-hash algorithm and seed that named
the chunk. Keys are ``vllm-<format digest>-<offload key hex>``, so a reader that disagrees on any
fact derives other keys and misses instead of loading foreign bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import msgspec

from hicache_storage.errors import ConfigError

__all__ = ["ChunkFormat", "chunk_key", "hash_setting"]

_UNSTABLE_ALGOS = frozenset({"xxhash", "xxhash_cbor"})
SCHEMA_VERSION = 1


class ChunkFormat(msgspec.Struct, frozen=True, kw_only=True):
    """Every fact a chunk's bytes depend on; its :attr:`digest` prefixes the chunk's keys."""

    model: str
    model_identity: str
    dtype: str
    kv_cache_dtype: str
    tokens_per_hash: int
    blocks_per_chunk: int
    groups: tuple[tuple[int, tuple[str, ...]], ...]
    worker_kv_bytes_per_block: int
    row_bytes: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    replicated_layout: bool
    canonical_layout: bool
    kv_cache_layout: str
    device: str
    attention_layout: str
    hash_algo: str
    hash_seed: str
    schema: int = SCHEMA_VERSION

    @property
    def digest(self) -> str:
        """16 hex digits of a BLAKE2b digest of the msgpack record (stable across processes)."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=8).hexdigest()


def hash_setting(algo: str, env: Mapping[str, str] | None = None) -> str:
    """Return the block-hash seed's identity, refusing settings that give unstable keys.

    vLLM seeds its block-hash chain from ``PYTHONHASHSEED`` when set; otherwise a SHA-256
    family algorithm uses a fixed seed and an xxHash one a random seed per process.

    Raises
    ------
    ConfigError
        For an xxHash algorithm without ``PYTHONHASHSEED``: its block hashes differ in every
        process, so nothing one engine stores could be found by another.
    """
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return "env:" + hashlib.blake2b(seed.encode(), digest_size=8).hexdigest()
    if algo in _UNSTABLE_ALGOS:
        raise ConfigError(
            f"--prefix-caching-hash-algo {algo} seeds block hashes randomly in every process, "
            "so chunks stored by one engine would never be found by another: set "
            "PYTHONHASHSEED to one value on every vLLM instance that shares the store, or use "
            "sha256 / sha256_cbor"
        )
    return "default"


def chunk_key(digest: str, offload_key: bytes) -> str:
    """Return the store key of the chunk vLLM names ``offload_key`` (block hash + group)."""
    return f"vllm-{digest}-{offload_key.hex()}"
