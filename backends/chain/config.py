"""Options of the ``chain`` backend: its tiers, fastest first, and how pages move between them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from hicache_storage.config import LayerConfig
from hicache_storage.kit.options import check_count, check_seconds
from hicache_storage.redact import redacted_repr

__all__ = ["MAX_PENDING_PAGES", "ChainConfig", "TierConfig", "WritePolicy"]

WritePolicy = Literal["through", "behind"]

MAX_PENDING_PAGES = 1 << 20
"""Most pages a write-behind queue may hold: it holds keys, not bytes (the pages are read back
from the first tier when they are copied), so a million keys is a few hundred MB at worst."""

TIER_LAYERS = LayerConfig(verify=False)
"""A tier's layers unless its entry names others: degrade-to-miss and health, so a tier that
fails or stops answering costs the chain a counted miss, not an error or a wait, and metrics
per tier. Pages are verified once, by the layers around the whole chain (a page promoted from
a later tier is checked when the chain answers it), so the tiers do not store records of their
own."""


class TierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tier of a chain.

    Attributes
    ----------
    backend
        A registered backend name (not ``chain``) or a URL whose scheme a backend claims.
    options
        That backend's options. Their secrets never show in ``repr``.
    layers
        The layers around this tier (see :data:`TIER_LAYERS` for the default and why).
    """

    backend: str
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    layers: LayerConfig = TIER_LAYERS

    def __post_init__(self) -> None:
        if self.backend == "chain":
            raise ValueError("a chain's tier cannot be another chain: list its tiers instead")

    def __repr__(self) -> str:
        return redacted_repr(self)


class ChainConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the chain backend.

    Attributes
    ----------
    tiers
        The tiers, fastest first (for example ``file`` on a local NVMe, then ``redis`` or
        ``s3``): a read is served by the first tier holding the page.
    write_policy
        ``"through"``: a write stores every tier before it returns (the tiers written at once).
        ``"behind"``: a write stores the first tier and returns; a background thread copies the
        pages the first tier stored to the later tiers, reading them back from it. A page the
        first tier could not store is written through to the later ones at once, so a full
        local disk never loses a write.
    promote_after_hits
        A page a later tier served is copied into the earlier tiers once it has been read this
        many times from later tiers (1: at its first such read). 0 never promotes.
    max_pending_pages
        With ``"behind"``: the most pages waiting to reach the later tiers; a write beyond it
        is not queued (counted as shed: the later tiers miss that page, the first holds it).
    drain_timeout_s
        How long ``close()`` waits for queued pages to reach the later tiers.
    """

    tiers: tuple[TierConfig, ...]
    write_policy: WritePolicy = "through"
    promote_after_hits: int = 1
    max_pending_pages: int = 4096
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a chain needs at least one tier")
        check_count("promote_after_hits", self.promote_after_hits, minimum=0)
        check_count("max_pending_pages", self.max_pending_pages, maximum=MAX_PENDING_PAGES)
        check_seconds("drain_timeout_s", self.drain_timeout_s, allow_zero=True)

    def __repr__(self) -> str:
        return redacted_repr(self)
