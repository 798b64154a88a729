"""Page hashing, the key rule and the default rank-suffix key scheme."""

from __future__ import annotations

from hicache_storage.keys.hashing import (
    HASH_ALGORITHM,
    chain_hashes,
    hash_page,
    namespace_seed,
    page_hashes,
)
from hicache_storage.keys.rank_suffix import RankSuffixScheme, sanitize_model_name
from hicache_storage.keys.validation import MAX_KEY_LENGTH, validate_key, validate_keys

__all__ = [
    "HASH_ALGORITHM",
    "MAX_KEY_LENGTH",
    "RankSuffixScheme",
    "chain_hashes",
    "hash_page",
    "namespace_seed",
    "page_hashes",
    "sanitize_model_name",
    "validate_key",
    "validate_keys",
]
