"""What a page object's bytes mean, reduced to a short tag that keys and records carry.

Two writers whose pages have the same hash produce different bytes when anything below differs:
the model (other weights give other KV), the element type, the geometry (layers, KV heads, head
dim, page size), the attention kind or the object layout (a ``page_first`` host pool stores a
page's bytes in another order than a ``layer_first`` one). A reader may only take an object whose
:class:`ObjectFormat` equals its own, so the rank-suffix scheme appends the format's
:attr:`~ObjectFormat.tag` to every key (``_f<tag>``) and the file backend's SGLang-compatible
naming, whose keys cannot change, keeps the format of each key suffix in a manifest instead.
The unified scheme's namespace digest already covers the same facts.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

import msgspec

from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import positive_int

__all__ = ["FORMAT_VERSION", "ObjectFormat", "is_format_tag"]

FORMAT_VERSION = 1
"""Bumped whenever the encoding of :class:`ObjectFormat` changes, so old tags never collide."""

_TAG = re.compile(r"[0-9a-f]{16}")


def is_format_tag(text: str) -> bool:
    """Whether ``text`` has the shape of :attr:`ObjectFormat.tag` (16 lowercase hex digits)."""
    return _TAG.fullmatch(text) is not None


class ObjectFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a reader must share with a writer to interpret one page object's bytes.

    Attributes
    ----------
    model
        Model identity (name, and for the tier engine's seeded models a digest of the config
        and the weights' seed). Two models with the same geometry differ only here.
    dtype
        Element type of the stored KV (``"bfloat16"``, ``"float8_e4m3fn"``, ...).
    attention
        ``"mha"`` (K and V per head) or ``"mla"`` (one latent vector per token).
    layers
        Layers the object covers.
    kv_heads
        KV heads the object holds (0 for MLA).
    head_dim
        Elements per head (the latent width for MLA).
    page_size
        Tokens per page.
    layout
        Byte order of the object: the host pool layout it was written from.
    version
        ``FORMAT_VERSION`` of the encoding.
    """

    model: str
    dtype: str
    attention: Literal["mha", "mla"]
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    layout: str
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("layers", "head_dim", "page_size"):
            positive_int(f"object format: {name}", getattr(self, name), ConfigError)
        if isinstance(self.kv_heads, bool) or not isinstance(self.kv_heads, int):
            raise ConfigError(f"object format: kv_heads must be an int, got {self.kv_heads!r}")
        if (self.attention == "mla") != (self.kv_heads == 0):
            raise ConfigError(
                f"object format: an {self.attention} object has "
                f"{'no' if self.attention == 'mla' else 'at least one'} KV head, "
                f"got kv_heads={self.kv_heads}"
            )

    @classmethod
    def of_pool(cls, pool: Any, *, model: str, dtype: str | None = None) -> ObjectFormat:
        """Return the format of the page objects of a host pool (MHA or MLA, any layout).

        ``dtype`` overrides the pool's element type where the pool stores a logical type as
        raw bytes (fp8 KV kept in a ``uint8`` pool).
        """
        mla = bool(getattr(pool, "is_mla", False))
        layout = pool.layout
        return cls(
            model=model,
            dtype=dtype or str(pool.dtype).removeprefix("torch."),
            attention="mla" if mla else "mha",
            layers=pool.layer_num,
            kv_heads=0 if mla else pool.head_num,
            head_dim=pool.kv_cache_dim if mla else pool.head_dim,
            page_size=pool.page_size,
            layout=str(getattr(layout, "value", layout)),
        )

    @property
    def tag(self) -> str:
        """16 hex digits of a BLAKE2b digest of the msgpack record (stable across processes)."""
        encoded = msgspec.msgpack.encode(self)
        return hashlib.blake2b(encoded, digest_size=8).hexdigest()

    def describe(self) -> str:
        """One line for error messages: every fact, in order."""
        heads = "" if self.attention == "mla" else f" x {self.kv_heads} heads"
        return (
            f"model {self.model!r}, {self.dtype}, {self.attention.upper()} {self.layers} layers"
            f"{heads} x {self.head_dim}, {self.page_size}-token pages, {self.layout} layout"
        )
