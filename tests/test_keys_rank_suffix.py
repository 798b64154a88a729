"""The default rank-suffix key scheme."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_storage.errors import ConfigError
from hicache_storage.keys.hashing import page_hashes
from hicache_storage.keys.rank_suffix import RankSuffixScheme, sanitize_model_name
from hicache_storage.keys.validation import MAX_KEY_LENGTH, validate_key

H = "0123456789abcdef" * 4
MODEL = "Qwen/Qwen3-8B"


def test_default_scheme() -> None:
    scheme = RankSuffixScheme()
    assert scheme.suffix == "__0_1"
    assert scheme.key(H) == H + "__0_1"
    assert scheme.is_writer


def test_mha_keys_differ_across_tp_ranks() -> None:
    schemes = [RankSuffixScheme(MODEL, tp_rank=r, tp_size=4) for r in range(4)]
    assert [s.suffix for s in schemes] == [f"_Qwen-Qwen3-8B_{r}_4" for r in range(4)]
    assert len({s.key(H) for s in schemes}) == 4
    assert all(s.is_writer for s in schemes)


def test_mla_keys_are_shared_and_rank_0_writes() -> None:
    schemes = [RankSuffixScheme(MODEL, tp_rank=r, tp_size=4, is_mla=True) for r in range(4)]
    assert {s.key(H) for s in schemes} == {H + "_Qwen-Qwen3-8B"}
    assert [s.is_writer for s in schemes] == [True, False, False, False]


@pytest.mark.parametrize(
    ("kwargs", "suffix"),
    [
        ({"pp_rank": 1, "pp_size": 2}, "_m_3_8_2_1"),
        ({"cp_rank": 2, "cp_size": 4}, "_m_3_8_cp2_4"),
        ({"pp_rank": 1, "pp_size": 2, "cp_rank": 0, "cp_size": 2}, "_m_3_8_2_1_cp0_2"),
        ({"pp_rank": 1, "pp_size": 2, "is_mla": True}, "_m_2_1"),
        ({"cp_rank": 1, "cp_size": 2, "is_mla": True}, "_m_cp1_2"),
    ],
)
def test_pp_and_cp_suffixes(kwargs: dict[str, Any], suffix: str) -> None:
    assert RankSuffixScheme("m", tp_rank=3, tp_size=8, **kwargs).suffix == suffix


@pytest.mark.parametrize(
    ("kwargs", "suffix"),
    [
        ({}, "__0_1"),
        ({"tp_rank": 1, "tp_size": 2}, "__1_2"),
        ({"is_mla": True}, "_"),
        ({"is_mla": True, "pp_rank": 0, "pp_size": 2}, "__2_0"),
        ({"cp_rank": 1, "cp_size": 2}, "__0_1_cp1_2"),
    ],
)
def test_empty_model_leaves_an_empty_part_as_sglang_does(
    kwargs: dict[str, Any], suffix: str
) -> None:
    assert RankSuffixScheme(**kwargs).suffix == suffix


@pytest.mark.parametrize(
    ("name", "clean"),
    [
        ("Qwen/Qwen3-8B", "Qwen-Qwen3-8B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama-Llama-3.1-8B-Instruct"),
        ("/models/llama", "-models-llama"),
        ("org/Model_v2.1", "org-Model_v2.1"),
        ("ok_name.v1", "ok_name.v1"),
    ],
)
def test_sanitize_model_name_is_sglangs(name: str, clean: str) -> None:
    assert sanitize_model_name(name) == clean
    assert RankSuffixScheme(name).suffix == f"_{clean}_0_1"


@pytest.mark.parametrize(
    ("name", "bad"),
    [("/models/my model", "' '"), ("org/m:v2", "':'"), ("a/../b", "'..'"), ("déjà", "'é'")],
)
def test_model_names_sglang_would_keep_but_keys_cannot_hold_are_refused(
    name: str, bad: str
) -> None:
    # A lossy mapping would let two models share keys; a clear start-up error is the safe answer.
    with pytest.raises(ConfigError, match=f"model_name {name!r} cannot be part of a key.*{bad}"):
        RankSuffixScheme(name)


_name_st = st.text(alphabet="abcXYZ019_-./", max_size=60).filter(lambda n: ".." not in n)


@given(_name_st, st.booleans(), st.integers(1, 4), st.integers(1, 4))
def test_keys_of_valid_names_pass_validation(name: str, mla: bool, pp: int, cp: int) -> None:
    if ".." in name.replace("/", "-"):
        return
    scheme = RankSuffixScheme(name, 1, 2, pp - 1, pp, cp - 1, cp, is_mla=mla)
    for h in page_hashes(range(10), 4):
        assert validate_key(scheme.key(h)) == scheme.key(h)


def test_too_long_model_name_raises() -> None:
    RankSuffixScheme("m" * (MAX_KEY_LENGTH - 64 - 1), is_mla=True)
    with pytest.raises(ConfigError, match="model_name is too long"):
        RankSuffixScheme("m" * (MAX_KEY_LENGTH - 64), is_mla=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"tp_rank": 1, "tp_size": 1}, r"tp_rank must be in \[0, tp_size=1\)"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"pp_rank": 2, "pp_size": 2}, "pp_rank"),
        ({"pp_size": -1}, "pp_size"),
        ({"cp_rank": 3, "cp_size": 2}, "cp_rank"),
        ({"cp_size": 0}, "cp_size"),
        ({"tp_rank": 1.0, "tp_size": 2}, "tp_rank must be int"),
        ({"tp_size": True}, "tp_size must be int"),
        ({"model_name": None}, "model_name must be str"),
        ({"is_mla": 1}, "is_mla must be bool"),
    ],
)
def test_invalid_config_raises(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RankSuffixScheme(**kwargs)  # type: ignore[arg-type]


def test_keys_and_owns() -> None:
    hashes = page_hashes(range(10), 4)
    mine = RankSuffixScheme(MODEL, tp_rank=0, tp_size=2)
    other = RankSuffixScheme(MODEL, tp_rank=1, tp_size=2)
    keys = mine.keys(hashes)
    assert keys == [mine.key(h) for h in hashes]
    assert all(mine.owns(k) for k in keys)
    assert not any(other.owns(k) for k in keys)
    assert not RankSuffixScheme(MODEL, 0, 2, pp_rank=0, pp_size=2).owns(keys[0])
    assert not RankSuffixScheme("other", 0, 2).owns(keys[0])


@pytest.mark.parametrize(
    "key",
    [
        H.upper() + "_m_0_1",
        H[:-1] + "_m_0_1",
        "x" + H + "_m_0_1",
        H[:-1] + "g_m_0_1",
        H + "_m_0_1_",
        H + "_m_0_1.tmp",
        H,
        "",
    ],
)
def test_owns_rejects_foreign_keys(key: str) -> None:
    assert not RankSuffixScheme("m").owns(key)


def test_owns_with_the_shortest_suffix() -> None:
    scheme = RankSuffixScheme(is_mla=True)
    assert scheme.owns(H + "_")
    assert not scheme.owns(H)
    assert not scheme.owns(H + "__0_1")


def test_scheme_is_frozen_and_comparable() -> None:
    scheme = RankSuffixScheme(MODEL, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheme.tp_rank = 0  # type: ignore[misc]
    assert scheme == RankSuffixScheme(MODEL, 1, 2)
    assert hash(scheme) == hash(RankSuffixScheme(MODEL, 1, 2))
    assert "_suffix" not in repr(scheme)
