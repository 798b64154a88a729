"""The key rule: a safe alphabet, no traversal, bounded length, str only."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_storage.errors import InvalidKeyError
from hicache_storage.keys.validation import MAX_KEY_LENGTH, validate_key, validate_keys

SAFE_CHARS = string.ascii_letters + string.digits + "_-."
ALNUM = string.ascii_letters + string.digits


@pytest.mark.parametrize(
    "key",
    [
        "a",
        "0",
        "abc_DEF-123.bin",
        "a.b.c",
        "x.",
        "a" * MAX_KEY_LENGTH,
        "0" * 64 + "_Qwen-Qwen3-8B_0_1",
    ],
)
def test_valid_keys_are_returned_unchanged(key: str) -> None:
    assert validate_key(key) is key


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("../x", "starts with '.'"),
        ("a/../b", "contains '/'"),
        ("..", "starts with '.'"),
        ("a..b", "contains '..'"),
        ("a/b", "contains '/'"),
        ("/abs", "starts with '/'"),
        ("a\\b", r"contains '\\\\'"),
        ("a\x00b", r"contains '\\x00'"),
        ("a b", "contains ' '"),
        ("a\tb", r"contains '\\t'"),
        ("ab\n", r"contains '\\n'"),
        (" a", "starts with ' '"),
        ("caf\u00e9", "contains 'é'"),
        ("\u0662x", "starts with"),
        ("", "empty"),
        (".hidden", "starts with '.'"),
        ("_a", "starts with '_'"),
        ("-a", "starts with '-'"),
        ("a" * (MAX_KEY_LENGTH + 1), "201 characters long, the limit is 200"),
    ],
)
def test_invalid_keys_name_the_rule(key: str, reason: str) -> None:
    with pytest.raises(InvalidKeyError, match=reason) as info:
        validate_key(key)
    assert "keys must use ASCII letters, digits" in str(info.value)


@pytest.mark.parametrize("key", [b"abc", None, 123, 1.5, ["a"], object()])
def test_non_str_keys_are_refused(key: object) -> None:
    with pytest.raises(InvalidKeyError, match="key must be str"):
        validate_key(key)


def test_message_quotes_a_truncated_repr() -> None:
    key = "/" + "x" * 500
    with pytest.raises(InvalidKeyError) as info:
        validate_key(key)
    quoted = str(info.value).split(":", 1)[0].removeprefix("invalid key ")
    assert len(quoted) <= 80
    assert quoted.startswith("'/xxx")


def test_invalid_key_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        validate_key("a/b")


def test_validate_keys() -> None:
    assert validate_keys(["a", "b.c"]) == ["a", "b.c"]
    assert validate_keys([]) == []
    with pytest.raises(InvalidKeyError, match="'b/c'"):
        validate_keys(["a", "b/c", ""])


@given(st.text(max_size=MAX_KEY_LENGTH + 5))
def test_accepted_keys_obey_the_rule(key: str) -> None:
    try:
        validate_key(key)
    except InvalidKeyError:
        return
    assert 0 < len(key.encode()) <= MAX_KEY_LENGTH
    assert key[0] in ALNUM
    assert set(key) <= set(SAFE_CHARS)
    assert ".." not in key


@given(
    st.builds(
        str.__add__,
        st.sampled_from(ALNUM),
        st.text(alphabet=SAFE_CHARS, max_size=MAX_KEY_LENGTH - 1),
    ).map(lambda key: key.replace("..", ".a"))
)
def test_safe_alphabet_keys_are_accepted(key: str) -> None:
    assert validate_key(key) == key
