"""Page hashes bit-compatible with SGLang 0.5.x HiCache.

A page hash is ``sha256(prior_digest || token_0 || token_1 || ...)`` where every token is a
4-byte little-endian unsigned integer and ``prior_digest`` is the 32 raw bytes of the previous
page's digest (absent for the first page of an unsalted chain). A page holding a token of
``2**32`` or more is hashed as ``sha256(prior_digest || 0xff || tokens as 8-byte little-endian
words)`` instead: the odd length of the tag keeps such pages apart from every 4-byte page, as in
SGLang's native hash (token ids up to ``2**63 - 1``). Chaining makes a page's hash
identify the whole prefix up to and including that page, which is what makes prefix reuse across
requests and engines safe. Keeping the exact byte layout lets this SDK share an L3 store with
SGLang engines.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

__all__ = [
    "HASH_ALGORITHM",
    "chain_hashes",
    "hash_page",
    "namespace_seed",
    "page_hashes",
]

HASH_ALGORITHM = "sha256"
"""Name of the digest used for page hashes (as understood by :mod:`hashlib`)."""

_NAMESPACE_TAG = b"sglang-cache-namespace-v1"
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_NARROW_LIMIT = 2**32
_TOKEN_LIMIT = 2**63
_TOKEN_DTYPE = np.dtype("<u4")
_WIDE_DTYPE = np.dtype("<u8")
_WIDE_TAG = b"\xff"


def _prior_bytes(prior_hash: str | None) -> bytes | None:
    """Decode a 64-char hex prior hash into its 32 digest bytes; ``None`` and ``""`` give ``None``.

    SGLang treats an empty prior hash as no prior (``bytes.fromhex(p) if p else None``).
    """
    if prior_hash is None or prior_hash == "":
        return None
    if not isinstance(prior_hash, str) or _HEX_DIGEST.fullmatch(prior_hash) is None:
        raise ValueError(
            f"prior_hash must be a 64-character hex sha256 digest or None, got {prior_hash!r:.80}"
        )
    return bytes.fromhex(prior_hash)


def _token_array(tokens: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """Convert token ids once to little-endian uint64 after checking their range.

    Accepts lists of ints, numpy arrays and CPU torch tensors (anything ``numpy.asarray``
    understands). The range is checked before converting so that an out-of-range id fails
    loudly instead of silently wrapping around.
    """
    arr = np.asarray(tokens)
    if arr.dtype.kind == "f" and isinstance(tokens, (list, tuple)):
        # numpy turns ints past int64 into floats; keep them exact for the range check.
        arr = np.asarray(tokens, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got an array of shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=_WIDE_DTYPE)
    if arr.dtype.kind == "O":
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr):
            raise ValueError("tokens must be integers")
        low, high = min(arr), max(arr)
    elif arr.dtype.kind in "iu":
        low, high = arr.min(), arr.max()
    else:
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if low < 0 or high >= _TOKEN_LIMIT:
        bad = low if low < 0 else high
        raise ValueError(f"token ids must lie in [0, 2**63), got {int(bad)}")
    return arr.astype(_WIDE_DTYPE)


def _page_bytes(page: npt.NDArray[np.uint64]) -> bytes:
    """Return the hashed bytes of one page: 4-byte tokens, or the tag and 8-byte tokens."""
    if page.size and int(page.max()) >= _NARROW_LIMIT:
        return _WIDE_TAG + page.tobytes()
    return page.astype(_TOKEN_DTYPE).tobytes()


def _check_page_size(page_size: int) -> int:
    """Return ``page_size`` as an int, refusing bools, non-integers and values below 1."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size}")
    return int(page_size)


def hash_page(tokens: npt.ArrayLike, prior_hash: str | None = None) -> str:
    """Hash one page of tokens, chained onto ``prior_hash``.

    Parameters
    ----------
    tokens
        Token ids of the page, each in ``[0, 2**63)``.
    prior_hash
        Hex digest of the previous page, a namespace seed, or ``None`` (or ``""``) for an
        unchained page.

    Returns
    -------
    str
        The 64-character lowercase hex sha256 digest (SGLang's ``get_hash_str``).
    """
    prior = _prior_bytes(prior_hash)
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    h.update(_page_bytes(_token_array(tokens)))
    return h.hexdigest()


def page_hashes(tokens: npt.ArrayLike, page_size: int, prior_hash: str | None = None) -> list[str]:
    """Hash ``tokens`` page by page, each page chained onto the previous one.

    The last, partial page is hashed too (as SGLang does), so ``len(result)`` is
    ``ceil(len(tokens) / page_size)``. Tokens are converted once.

    Parameters
    ----------
    tokens
        1-D token ids (list of ints, numpy array or CPU torch tensor), each in ``[0, 2**63)``.
    page_size
        Tokens per page, at least 1.
    prior_hash
        Hex digest page 0 chains onto (the last hash of an earlier chunk, or a namespace seed).

    Returns
    -------
    list[str]
        One 64-character lowercase hex digest per page.
    """
    step = _check_page_size(page_size)
    prior = _prior_bytes(prior_hash)
    arr = _token_array(tokens)
    out: list[str] = []
    if arr.size and int(arr.max()) < _NARROW_LIMIT:
        # Every page narrow: one conversion, then each page is a slice of the same bytes.
        data = memoryview(arr.astype(_TOKEN_DTYPE).tobytes())
        width = step * _TOKEN_DTYPE.itemsize
        pages: Iterable[bytes | memoryview] = (
            data[at : at + width] for at in range(0, len(data), width)
        )
    else:
        pages = (_page_bytes(arr[start : start + step]) for start in range(0, arr.size, step))
    for page in pages:
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(page)
        prior = h.digest()
        out.append(prior.hex())
    return out


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """Derive the prior hash that isolates a cache namespace (SGLang ``storage_namespace_seed``).

    Requests with a different ``extra_key`` (e.g. a LoRA adapter id) or ``cache_salt`` (e.g. a
    tenant secret) must never share pages, so their chains start from a different seed. Each
    part is length-prefixed and ``None`` is encoded apart from ``""``, so neither
    ``("ab", "c")`` vs ``("a", "bc")`` nor ``None`` vs ``""`` can collide.

    Returns
    -------
    str or None
        A 64-character hex digest, or ``None`` when both parts are ``None`` (no namespace).
    """
    if extra_key is None and cache_salt is None:
        return None
    d = hashlib.sha256(_NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            d.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise TypeError(
                f"extra_key and cache_salt must be str or None, got {type(part).__name__}"
            )
        enc = part.encode("utf-8")
        d.update(b"\x01" + len(enc).to_bytes(8, "little") + enc)
    return d.hexdigest()


def chain_hashes(
    tokens: npt.ArrayLike,
    page_size: int,
    extra_key: str | None = None,
    cache_salt: str | None = None,
    prior_hash: str | None = None,
) -> list[str]:
    """Hash the pages of a request in its cache namespace.

    Starts a new chain from :func:`namespace_seed` of ``extra_key`` and ``cache_salt``; when
    ``prior_hash`` is given the chain continues from it instead, since that hash already
    carries the namespace of the pages before it. As in SGLang's requests, an empty
    ``cache_salt`` is no salt and an empty ``prior_hash`` no prior (an empty ``extra_key``
    stays a namespace of its own).
    """
    if prior_hash:
        seed: str | None = prior_hash
    else:
        seed = namespace_seed(extra_key, cache_salt or None)
    return page_hashes(tokens, page_size, seed)
