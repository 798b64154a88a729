"""The unified key scheme: keys that name what an object holds, never who wrote it.

A KV object is one page by a layer range by a head group, K and V together. Its key is::

    {page_hash}_{digest}_L{first}-{end}[_H{group}]

with the layer range half-open in absolute model layers and ``group`` the global index of the head
group (absent when every rank holds the same KV, as with MLA). ``digest`` is a short hash of the
:class:`KVNamespace`: every fact two deployments must share before they may exchange bytes
(model, *logical* dtype, page size, head and layer grids, the object byte layout, the schema
version). Any deployment whose shard tiles that grid derives the same keys for the same bytes, so a
TP2 rank's objects are exactly the union of two TP4 ranks' and a single pipeline stage's are the
union of the stages'.

:func:`plan_unified` derives one rank's objects from its facts and refuses a shard that does not
tile the grid: such a rank would write objects nobody can reassemble, and the symptom would be
silently wrong KV or a hit rate of zero rather than an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Iterable
from typing import Final

import msgspec

from hicache_storage.errors import ConfigError, UnsupportedOperationError
from hicache_storage.keys.validation import MAX_KEY_LENGTH
from hicache_storage.kit.options import positive_int

__all__ = [
    "OBJECT_LAYOUTS",
    "SCHEMA_VERSION",
    "KVNamespace",
    "KeySchemeError",
    "UnifiedObject",
    "UnifiedPlan",
    "dtype_itemsize",
    "lcm_of",
    "logical_dtype",
    "plan_unified",
]

SCHEMA_VERSION: Final = 1

OBJECT_LAYOUTS: Final = {
    "page-unified-v1": "K of every layer of the range, then V: (2, layers, page, heads, dim)",
    "page-unified-layer-major-v1": "per layer, K then V: (layers, 2, page, heads, dim)",
}
"""Byte orders an object may have, by name. MLA objects are ``(layers, page, dim)`` in both."""

_DTYPES: Final = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES: Final = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}
_HASH = re.compile(r"[0-9a-f]{64}")


class KeySchemeError(ConfigError):
    """A shard that does not tile the declared grid, or an incomplete namespace."""


def logical_dtype(dtype: object) -> str:
    """Return the canonical name of a logical KV dtype (a ``torch.dtype`` or a name).

    fp8 variants keep their own names although they all store as bytes: objects of e4m3 and
    e5m2 must never share a keyspace.

    Raises
    ------
    KeySchemeError
        If the dtype is not one of the known KV element types.
    """
    text = str(dtype).strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(text, text)
    if name not in _DTYPES:
        known = ", ".join(sorted(_DTYPES))
        raise KeySchemeError(f"unknown KV dtype {dtype!r}; use one of {known}")
    return name


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the logical dtype ``name`` (see :func:`logical_dtype`)."""
    return _DTYPES[logical_dtype(name)]


class KVNamespace(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything two deployments must agree on to exchange KV objects; frozen and versioned.

    Attributes
    ----------
    schema_version
        Version of this record and of the key format.
    model_id
        The model (weights) whose KV this is.
    dtype
        The logical element type (``float8_e4m3fn`` and ``float8_e5m2`` differ).
    page_size
        Tokens per page.
    rank_replicated
        Whether every rank holds the same KV (MLA): objects have no head axis.
    total_kv_heads
        KV heads of the whole model (0 when rank-replicated).
    head_group
        KV heads per object (0 when rank-replicated).
    layer_partition
        Layers per object: the layer grid every pipeline stage must start on.
    object_layout
        Byte order of an object (a key of :data:`OBJECT_LAYOUTS`).
    """

    schema_version: int
    model_id: str
    dtype: str
    page_size: int
    rank_replicated: bool
    total_kv_heads: int
    head_group: int
    layer_partition: int
    object_layout: str

    def digest(self) -> str:
        """Return the key prefix of this namespace: ``ukv{version}-`` and 16 hex digits.

        The record is encoded with msgpack, fields in declaration order, so the digest is the
        same in every process and release that keeps this schema version.
        """
        encoded = msgspec.msgpack.encode(self)
        return f"ukv{self.schema_version}-{hashlib.sha256(encoded).hexdigest()[:16]}"


@dataclasses.dataclass(frozen=True, slots=True)
class UnifiedObject:
    """One object a rank holds per page, and the part of its host pool it covers.

    Attributes
    ----------
    suffix
        What follows the page hash in the key: ``_{digest}_L{a}-{b}[_H{g}]``.
    layers
        Absolute model layers of the object.
    pool_layers
        The same layers as indices of the rank's host pool (which holds only its stage).
    heads
        Global KV heads of the object (empty when rank-replicated).
    pool_heads
        The same heads as indices of the rank's host pool.
    """

    suffix: str
    layers: range
    pool_layers: range
    heads: range
    pool_heads: range


@dataclasses.dataclass(frozen=True, slots=True)
class UnifiedPlan:
    """One rank's objects per page under the unified scheme.

    Attributes
    ----------
    namespace
        The shared namespace record.
    objects
        This rank's objects of every page, layer-major then head-minor.
    is_writer
        Whether this rank writes: ranks holding replicated KV leave it to the first replica.
    """

    namespace: KVNamespace
    objects: tuple[UnifiedObject, ...]
    is_writer: bool
    digest: str = dataclasses.field(init=False)
    _suffixes: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", self.namespace.digest())
        object.__setattr__(self, "_suffixes", frozenset(o.suffix for o in self.objects))

    @property
    def keys_per_page(self) -> int:
        """Objects (and keys) per page for this rank."""
        return len(self.objects)

    def page_keys(self, page_hash: str) -> list[str]:
        """Return the keys of one page's objects, in :attr:`objects` order."""
        return [page_hash + obj.suffix for obj in self.objects]

    def keys(self, page_hashes: Iterable[str]) -> list[str]:
        """Return the keys of every page's objects: page-major, then :attr:`objects` order."""
        suffixes = [obj.suffix for obj in self.objects]
        return [page_hash + suffix for page_hash in page_hashes for suffix in suffixes]

    def owns(self, key: str) -> bool:
        """Whether ``key`` is a page hash followed by one of this rank's object suffixes."""
        return _HASH.fullmatch(key[:64]) is not None and key[64:] in self._suffixes


def _positive(name: str, value: object, hint: str = "") -> int:
    return positive_int(name, value, lambda message: KeySchemeError(message + hint))


def plan_unified(
    *,
    model_id: str,
    dtype: object,
    page_size: int,
    num_layers: int,
    layer_range: tuple[int, int] | None = None,
    layer_partition: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    local_kv_heads: int = 0,
    total_kv_heads: int | None = None,
    head_group: int | None = None,
    tp_lcm_size: int | None = None,
    is_mla: bool = False,
    cp_size: int = 1,
    object_layout: str = "page-unified-v1",
) -> UnifiedPlan:
    """Derive the namespace and one rank's objects from the rank's facts.

    Parameters
    ----------
    model_id
        The model; must not be empty.
    dtype
        Logical KV element type (a ``torch.dtype`` or a name; see :func:`logical_dtype`).
    page_size
        Tokens per page.
    num_layers
        Layers of the whole model.
    layer_range
        ``(first, end)``: the absolute layers this pipeline stage holds; default all.
    layer_partition
        Layers per object; every stage must start on this grid. Default ``num_layers`` (one
        layer chunk: fine unless deployments with different pipeline splits share the store).
    tp_rank, tp_size
        Attention tensor-parallel position of the rank.
    local_kv_heads
        KV heads in this rank's pool (MHA/GQA).
    total_kv_heads
        KV heads of the model; default ``local_kv_heads * tp_size``. Fewer heads than ranks
        means heads are replicated across ``tp_size // total_kv_heads`` ranks each.
    head_group, tp_lcm_size
        The head grid, one of the two: KV heads per object, or the least common multiple of the
        attention-TP sizes of every deployment sharing the store (``head_group =
        total_kv_heads // tp_lcm_size``). Required for MHA; forbidden for MLA.
    is_mla
        Whether KV is replicated on every rank (MLA): objects have no head axis.
    cp_size
        Attention context-parallel size; only 1 is supported.
    object_layout
        Byte order of objects (a key of :data:`OBJECT_LAYOUTS`).

    Raises
    ------
    KeySchemeError
        If a fact is missing or the shard does not tile the grid; the message says what to set.
    UnsupportedOperationError
        For attention context parallelism.
    """
    if cp_size != 1:
        raise UnsupportedOperationError(
            "the unified key scheme does not support attention context parallelism "
            f"(cp_size={cp_size}): context-parallel ranks hold sub-page slices; "
            "use key_scheme 'rank_suffix'"
        )
    if not isinstance(model_id, str) or not model_id.strip():
        raise KeySchemeError("model_id must name the model (e.g. the Hugging Face repo id)")
    name = logical_dtype(dtype)
    _positive("page_size", page_size)
    _positive("num_layers", num_layers)
    _positive("tp_size", tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise KeySchemeError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank!r}")
    if object_layout not in OBJECT_LAYOUTS:
        raise KeySchemeError(
            f"unknown object_layout {object_layout!r}; use one of {', '.join(OBJECT_LAYOUTS)}"
        )
    first, end = layer_range if layer_range is not None else (0, num_layers)
    if not 0 <= first < end <= num_layers:
        raise KeySchemeError(
            f"layer_range ({first}, {end}) must be a non-empty range within [0, {num_layers})"
        )
    partition = _positive(
        "layer_partition",
        num_layers if layer_partition is None else layer_partition,
        " (layers per object)",
    )
    if first % partition:
        raise KeySchemeError(
            f"this stage starts at layer {first}, off the layer grid (layer_partition="
            f"{partition}); set layer_partition to a common divisor of every pipeline stage "
            f"boundary of every deployment sharing the store"
        )
    if end != num_layers and end % partition:
        raise KeySchemeError(
            f"this stage ends at layer {end}, off the layer grid (layer_partition={partition}); "
            "only the last stage may end off the grid; set layer_partition to a common divisor "
            "of every pipeline stage boundary"
        )
    layer_chunks = [range(a, min(a + partition, end)) for a in range(first, end, partition)]

    if is_mla:
        if head_group or tp_lcm_size or total_kv_heads:
            raise KeySchemeError(
                "an MLA (rank-replicated) namespace has no head axis: leave head_group, "
                "tp_lcm_size and total_kv_heads unset"
            )
        namespace = KVNamespace(
            schema_version=SCHEMA_VERSION,
            model_id=model_id,
            dtype=name,
            page_size=page_size,
            rank_replicated=True,
            total_kv_heads=0,
            head_group=0,
            layer_partition=partition,
            object_layout=object_layout,
        )
        digest = namespace.digest()
        objects = tuple(
            UnifiedObject(
                suffix=f"_{digest}_L{chunk.start}-{chunk.stop}",
                layers=chunk,
                pool_layers=range(chunk.start - first, chunk.stop - first),
                heads=range(0),
                pool_heads=range(1),
            )
            for chunk in layer_chunks
        )
        return _checked(UnifiedPlan(namespace, objects, is_writer=tp_rank == 0))

    local = _positive("local_kv_heads", local_kv_heads, " (KV heads in this rank's host pool)")
    total = (
        local * tp_size if total_kv_heads is None else _positive("total_kv_heads", total_kv_heads)
    )
    if local * tp_size == total:
        replicas, first_head = 1, tp_rank * local
    elif local == 1 and total < tp_size and tp_size % total == 0:
        replicas = tp_size // total
        first_head = tp_rank // replicas
    else:
        raise KeySchemeError(
            f"{local} local KV heads on {tp_size} ranks do not tile {total} total KV heads; "
            "check local_kv_heads and total_kv_heads"
        )
    group = _head_group(total, tp_size, head_group, tp_lcm_size)
    if local % group:
        raise KeySchemeError(
            f"head_group={group} does not divide this rank's {local} KV heads (tp_size="
            f"{tp_size}); set head_group to total_kv_heads / lcm of the fleet's attention-TP "
            f"sizes, or tp_lcm_size to that lcm"
        )
    namespace = KVNamespace(
        schema_version=SCHEMA_VERSION,
        model_id=model_id,
        dtype=name,
        page_size=page_size,
        rank_replicated=False,
        total_kv_heads=total,
        head_group=group,
        layer_partition=partition,
        object_layout=object_layout,
    )
    digest = namespace.digest()
    objects = tuple(
        UnifiedObject(
            suffix=f"_{digest}_L{chunk.start}-{chunk.stop}_H{(first_head + h) // group}",
            layers=chunk,
            pool_layers=range(chunk.start - first, chunk.stop - first),
            heads=range(first_head + h, first_head + h + group),
            pool_heads=range(h, h + group),
        )
        for chunk in layer_chunks
        for h in range(0, local, group)
    )
    return _checked(UnifiedPlan(namespace, objects, is_writer=tp_rank % replicas == 0))


def _head_group(total: int, tp_size: int, head_group: int | None, tp_lcm_size: int | None) -> int:
    if head_group is not None and tp_lcm_size is not None:
        raise KeySchemeError("set head_group or tp_lcm_size, not both")
    if tp_lcm_size is not None:
        lcm = _positive("tp_lcm_size", tp_lcm_size)
        if lcm % tp_size:
            raise KeySchemeError(
                f"tp_lcm_size={lcm} must be a multiple of this deployment's tp_size={tp_size}: "
                "set it to the lcm of every attention-TP size sharing the store"
            )
        if total % lcm and lcm % total:
            raise KeySchemeError(
                f"tp_lcm_size={lcm} does not divide total_kv_heads={total} evenly; "
                "set head_group directly"
            )
        return max(total // lcm, 1)
    if head_group is None:
        raise KeySchemeError(
            "the unified key scheme needs the head grid of the fleet: set head_group (KV heads "
            f"per object, total_kv_heads={total} / lcm of the attention-TP sizes sharing the "
            "store) or tp_lcm_size (that lcm); without it deployments of other TP sizes would "
            "derive different keys and never hit"
        )
    group = _positive("head_group", head_group, " (KV heads per object)")
    if total % group:
        raise KeySchemeError(f"head_group={group} must divide total_kv_heads={total}")
    return group


def _checked(plan: UnifiedPlan) -> UnifiedPlan:
    longest = max(len(obj.suffix) for obj in plan.objects) + 64
    if longest > MAX_KEY_LENGTH:  # pragma: no cover - needs a model of ~10^100 layers
        raise KeySchemeError(f"unified keys would be {longest} characters long")
    return plan


def lcm_of(sizes: Iterable[int]) -> int:
    """Return the least common multiple of TP sizes: the fleet's ``tp_lcm_size``."""
    return math.lcm(*sizes)
