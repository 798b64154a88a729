"""Page hashing, the key rule and the two key schemes: rank-suffix (default) and unified."""

from __future__ import annotations

from hicache_storage.keys.format import ObjectFormat
from hicache_storage.keys.hashing import (
    HASH_ALGORITHM,
    chain_hashes,
    hash_page,
    namespace_seed,
    page_hashes,
)
from hicache_storage.keys.identity import kv_settings, model_identity, weights_fingerprint
from hicache_storage.keys.rank_suffix import RankSuffixScheme, sanitize_model_name
from hicache_storage.keys.scheme import KeyScheme
from hicache_storage.keys.unified import (
    OBJECT_LAYOUTS,
    KeySchemeError,
    KVNamespace,
    UnifiedObject,
    UnifiedPlan,
    lcm_of,
    logical_dtype,
    plan_unified,
)
from hicache_storage.keys.validation import MAX_KEY_LENGTH, validate_key, validate_keys

__all__ = [
    "HASH_ALGORITHM",
    "MAX_KEY_LENGTH",
    "OBJECT_LAYOUTS",
    "ObjectFormat",
    "KVNamespace",
    "KeyScheme",
    "KeySchemeError",
    "RankSuffixScheme",
    "UnifiedObject",
    "UnifiedPlan",
    "chain_hashes",
    "hash_page",
    "kv_settings",
    "lcm_of",
    "logical_dtype",
    "model_identity",
    "namespace_seed",
    "page_hashes",
    "plan_unified",
    "sanitize_model_name",
    "validate_key",
    "validate_keys",
    "weights_fingerprint",
]
