"""Page hashes must match SGLang's ``get_hash_str`` chaining byte for byte."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_storage.keys.hashing import (
    HASH_ALGORITHM,
    chain_hashes,
    hash_page,
    namespace_seed,
    page_hashes,
)


# A deliberately literal re-statement of SGLang's algorithm, one token at a time.
def ref_hash(tokens: list[int], prior: str | None = None) -> str:
    h = hashlib.sha256()
    if prior is not None:
        h.update(bytes.fromhex(prior))
    width = 4
    if any(t >= 2**32 for t in tokens):  # SGLang's wide page: a 0xff tag, then 8-byte tokens
        h.update(b"\xff")
        width = 8
    for t in tokens:
        h.update(t.to_bytes(width, "little", signed=False))
    return h.hexdigest()


def ref_pages(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    out = []
    for i in range(0, len(tokens), page_size):
        prior = ref_hash(tokens[i : i + page_size], prior)
        out.append(prior)
    return out


def ref_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    if extra_key is None and cache_salt is None:
        return None
    d = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            d.update(b"\x00")
        else:
            enc = part.encode("utf-8")
            d.update(b"\x01" + len(enc).to_bytes(8, "little") + enc)
    return d.hexdigest()


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)
wide_tokens_st = st.lists(st.integers(0, 2**32 - 1) | st.integers(2**32, 2**63 - 1), max_size=40)
prior_st = st.none() | st.binary(min_size=32, max_size=32).map(bytes.hex)
text_st = st.none() | st.text(max_size=12)

# Pinned once from the literal reference above; they guard against both implementations drifting.
PAGES_1234_P2 = [
    "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f",
    "c57b445f90651b9a650e516ab2238c965b21af35608a31c303e6d9e407f2915c",
]
SEED_LORA_A = "407c773a7c02b33bd4a62af6bf5fc77997c2c8067811ecf2b39e3839c3f4284b"
PAGES_RANGE10_P4_LORA_A = [
    "5c48059c3e71b713c24e974f77355a0cecd7ea96e46017c6b1885feee643b044",
    "994472f3d184e84671759be84e1689a1fcffbf19a221c5cb42337a2c3052237a",
    "a8892bd19e2c94377e50aed6405cc0270ef0974030934426b613e9ebb2049c7c",
]
SEED_EMPTY_SALT = "906782eeabf820a68eef4455ab98e5e86e311f658f7d7721723a97a90b81427e"
SEED_AB_C = "3d6b02ff0d7a0ce42a5ac4a58251ee0e63490c7de5eb46aa2eeaa3a0fdff5364"
SEED_A_BC = "b8080ec8e713ddb4b5469eaf5874a021a72286a24e6c55d2046f0acfb48a938b"
PAGES_EXTREME_P2 = [
    "5981693c8df83eea16da42a0f748facb299546688544a0c2887ed5ffbf086e86",
    "25ede0b01acb34724dd01f5b0bef5e3b1056b14649d2bc99b4c66d244d532a7a",
]


@given(tokens_st, st.integers(1, 20), prior_st)
def test_page_hashes_match_reference(tokens: list[int], page_size: int, prior: str | None) -> None:
    assert page_hashes(tokens, page_size, prior) == ref_pages(tokens, page_size, prior)


@given(tokens_st, prior_st)
def test_hash_page_matches_reference(tokens: list[int], prior: str | None) -> None:
    assert hash_page(tokens, prior) == ref_hash(tokens, prior)


@given(text_st, text_st)
def test_namespace_seed_matches_reference(extra_key: str | None, cache_salt: str | None) -> None:
    assert namespace_seed(extra_key, cache_salt) == ref_seed(extra_key, cache_salt)


@given(tokens_st, st.integers(1, 20), text_st, text_st)
def test_chain_hashes_start_from_namespace_seed(
    tokens: list[int], page_size: int, extra_key: str | None, cache_salt: str | None
) -> None:
    expected = ref_pages(tokens, page_size, ref_seed(extra_key, cache_salt or None))
    assert chain_hashes(tokens, page_size, extra_key, cache_salt) == expected


@given(tokens_st, st.integers(1, 20), st.integers(0, 80))
def test_chunked_hashing_continues_the_chain(tokens: list[int], page_size: int, cut: int) -> None:
    cut -= cut % page_size
    head = chain_hashes(tokens[:cut], page_size, "lora-a")
    tail = chain_hashes(tokens[cut:], page_size, "lora-a", prior_hash=head[-1] if head else None)
    assert head + tail == chain_hashes(tokens, page_size, "lora-a")


def test_pinned_vectors() -> None:
    assert page_hashes([1, 2, 3, 4], 2) == PAGES_1234_P2
    assert namespace_seed("lora-a", None) == SEED_LORA_A
    assert page_hashes(list(range(10)), 4, SEED_LORA_A) == PAGES_RANGE10_P4_LORA_A
    assert chain_hashes(list(range(10)), 4, extra_key="lora-a") == PAGES_RANGE10_P4_LORA_A
    assert namespace_seed(None, "") == SEED_EMPTY_SALT
    assert namespace_seed("ab", "c") == SEED_AB_C
    assert namespace_seed("a", "bc") == SEED_A_BC
    assert page_hashes([0, 2**32 - 1, 151643], 2) == PAGES_EXTREME_P2
    assert hash_page([]) == hashlib.sha256().hexdigest()


def test_namespace_seed_separates_parts() -> None:
    assert namespace_seed(None, None) is None
    seeds = {
        namespace_seed(None, ""),
        namespace_seed("", None),
        namespace_seed("", ""),
        namespace_seed("ab", "c"),
        namespace_seed("a", "bc"),
    }
    assert len(seeds) == 5


def test_empty_salt_and_prior_are_none_as_in_sglang_requests() -> None:
    assert chain_hashes([1, 2], 2, cache_salt="") == chain_hashes([1, 2], 2)
    assert chain_hashes([1, 2], 2, prior_hash="") == chain_hashes([1, 2], 2)
    assert page_hashes([1, 2], 2, "") == page_hashes([1, 2], 2)
    assert hash_page([1, 2], "") == hash_page([1, 2])
    assert chain_hashes([1, 2], 2, extra_key="") != chain_hashes([1, 2], 2)


@given(wide_tokens_st, st.integers(1, 8), prior_st)
def test_wide_pages_match_reference(tokens: list[int], page_size: int, prior: str | None) -> None:
    assert page_hashes(tokens, page_size, prior) == ref_pages(tokens, page_size, prior)


def test_a_wide_page_differs_from_its_narrow_twin() -> None:
    # Only the page holding the wide token changes encoding; the chain carries the change on.
    narrow = page_hashes([1, 2, 3, 4], 2)
    wide = page_hashes([1, 2, 3, 2**32], 2)
    assert wide[0] == narrow[0] and wide[1] != narrow[1]
    assert page_hashes([2**32, 0], 2) != page_hashes([0, 1, 0, 0], 4)


def test_partial_last_page_is_hashed() -> None:
    assert len(page_hashes(list(range(10)), 4)) == 3
    assert page_hashes([], 4) == []


def test_numpy_inputs_equal_list_input() -> None:
    tokens = [5, 0, 2**31, 2**32 - 1, 7]
    expected = page_hashes(tokens, 2)
    assert page_hashes(np.array(tokens, dtype=np.int64), 2) == expected
    assert page_hashes(np.array(tokens, dtype=np.uint32), 2) == expected
    assert page_hashes(np.array(tokens[::-1], dtype=np.uint64)[::-1], 2) == expected
    assert page_hashes(tuple(tokens), 2) == expected


def test_torch_tensor_equals_list_input() -> None:
    torch = pytest.importorskip("torch")
    tokens = [5, 0, 2**31, 2**32 - 1, 7]
    assert page_hashes(torch.tensor(tokens, dtype=torch.int64), 2) == page_hashes(tokens, 2)
    assert hash_page(torch.tensor(tokens)) == hash_page(tokens)


@pytest.mark.parametrize(
    "tokens",
    [[2**63], [-1], [1, 2**64], np.array([-1], dtype=np.int64), [1.0], [True], [[1, 2]], [1, None]],
)
def test_bad_tokens_raise(tokens: object) -> None:
    with pytest.raises(ValueError, match="token"):
        page_hashes(tokens, 2)  # type: ignore[arg-type]


def test_out_of_range_message_names_the_token() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\).*9223372036854775808"):
        page_hashes([1, 2**63], 4)


@pytest.mark.parametrize("page_size", [0, -1, 1.5, True])
def test_bad_page_size_raises(page_size: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], page_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("prior", ["ab", "g" * 64, "0" * 63, "0" * 65, b"0" * 64])
def test_bad_prior_hash_raises(prior: object) -> None:
    with pytest.raises(ValueError, match="prior_hash"):
        page_hashes([1], 1, prior)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prior_hash"):
        hash_page([1], prior)  # type: ignore[arg-type]


def test_non_str_namespace_part_raises() -> None:
    with pytest.raises(TypeError):
        namespace_seed(b"lora", None)  # type: ignore[arg-type]


def test_algorithm_constant() -> None:
    assert HASH_ALGORITHM == "sha256"
    assert len(page_hashes([1], 1)[0]) == hashlib.new(HASH_ALGORITHM).digest_size * 2
