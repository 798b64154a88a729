# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
# Triton ships no type information, and its kernels take untyped tensors by design.
"""The Triton kernel that moves listed token slots between a device pool and a host buffer.

One kernel serves every case: both directions, per layer or all layers, MHA or MLA, any element
type and any host layout. It copies raw bits: each row is seen as words of the widest integer type
(8, 4, 2 or 1 bytes) that the row size, the strides and every base address allow, split into
``CHUNKS_PER_ROW`` chunks of ``CHUNK`` words (a power of two, as ``tl.arange`` needs; MLA's 576
bf16 elements are 144 8-byte words, 9 chunks of 16). Where the host row's heads are apart
(``page_head``) the chunks are cut from each head, ``CHUNKS_PER_HEAD`` to a head, and a chunk's
host address adds its head's stride; elsewhere ``CHUNKS_PER_HEAD == CHUNKS_PER_ROW``.

A launch is a persistent grid of at most ``programs`` programs, each one CTA: program ``p`` takes
tiles ``p, p + programs, ...`` until the work is done. A grid of ``n`` one-CTA programs can occupy
at most ``n`` SMs, which is how a launch is confined to an SM budget (see ``docs/kernels.md``).
A tile is ``TOKENS`` tokens by ``LAYERS`` layers of one K/V half (:class:`TileShape`), each row
addressed on its own side by the formula of :mod:`hicache_storage.kernels.pools`, so index lists
need not be sorted or page-contiguous.

Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors, which is how CI tests it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hicache_storage.kernels.pools import DevicePool, HostView

if TYPE_CHECKING:
    from hicache_storage.kernels.dispatch import KernelConfig

__all__ = ["LaunchPlan", "launch", "pace_nanoseconds", "plan_transfer", "split_tokens"]

_WORD_TYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _tile_addresses(
    tile,
    dev_ptr,
    dev_offsets_ptr,
    dev_token_stride,
    host_ptr,
    host_stride_kv,
    host_stride_layer,
    host_stride_page,
    host_stride_token,
    host_stride_head,
    dev_index_ptr,
    host_index_ptr,
    n_tokens,
    layer_begin,
    layer_count,
    layer_total,
    token_blocks,
    layer_blocks,
    tile_tokens,
    CHUNK: tl.constexpr,
    CHUNKS_PER_ROW: tl.constexpr,
    CHUNKS_PER_HEAD: tl.constexpr,
    ALIGN: tl.constexpr,
    PAGE: tl.constexpr,
    TOKENS: tl.constexpr,
    LAYERS: tl.constexpr,
    SLOTS: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr,
):
    """Device and host addresses of one tile's chunks, and which chunks are live."""
    # The tile is (kv, token block, layer block); every division below the tile level is by a
    # compile-time constant, so the per-chunk index math stays cheap.
    if TOKEN_MAJOR:
        layer_block = tile % layer_blocks
        rest = tile // layer_blocks
        token_block = rest % token_blocks
        kv = rest // token_blocks
    else:
        token_block = tile % token_blocks
        rest = tile // token_blocks
        layer_block = rest % layer_blocks
        kv = rest // layer_blocks
    lane = tl.arange(0, SLOTS)
    chunk = lane % CHUNKS_PER_ROW
    row = lane // CHUNKS_PER_ROW
    if TOKEN_MAJOR:
        in_layer = row % LAYERS
        in_token = row // LAYERS
    else:
        in_token = row % TOKENS
        in_layer = row // TOKENS
    token = token_block * tile_tokens + in_token
    layer = layer_block * LAYERS + in_layer
    live = (in_token < tile_tokens) & (in_layer < LAYERS)
    live &= (token < n_tokens) & (layer < layer_count)
    layer += layer_begin
    dev_slot = tl.load(dev_index_ptr + token, mask=live, other=0)
    host_slot = tl.load(host_index_ptr + token, mask=live, other=0).to(tl.int32)
    dev_base = tl.load(dev_offsets_ptr + kv * layer_total + layer, mask=live, other=0)
    # Strides and offsets come in units of ALIGN words; multiplying by the constant here (rather
    # than hinting with tl.multiple_of, which constant folding can drop) lets Triton prove the
    # alignment it needs for 16-byte accesses.
    dev_row = (dev_base + dev_slot * dev_token_stride) * ALIGN + chunk * CHUNK
    if CHUNKS_PER_HEAD == CHUNKS_PER_ROW:
        # The host row is contiguous, like the device row.
        host_chunk = chunk * CHUNK
    else:
        # The host row's heads are apart (page_head): chunk c is in head c // CHUNKS_PER_HEAD.
        head = chunk // CHUNKS_PER_HEAD
        host_chunk = head.to(tl.int64) * host_stride_head * ALIGN
        host_chunk += (chunk % CHUNKS_PER_HEAD) * CHUNK
    host_row = (
        kv.to(tl.int64) * host_stride_kv
        + layer.to(tl.int64) * host_stride_layer
        + (host_slot // PAGE).to(tl.int64) * host_stride_page
        + (host_slot % PAGE).to(tl.int64) * host_stride_token
    ) * ALIGN + host_chunk
    cols = tl.arange(0, CHUNK)
    dev_at = dev_ptr + dev_row[:, None] + cols[None, :]
    host_at = host_ptr + host_row[:, None] + cols[None, :]
    return dev_at, host_at, live[:, None]


@triton.jit
def _nanoseconds():
    """Read the GPU's global nanosecond timer (PTX ``%globaltimer``)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _transfer_kernel(
    dev_ptr,
    dev_offsets_ptr,
    dev_token_stride,
    host_ptr,
    host_stride_kv,
    host_stride_layer,
    host_stride_page,
    host_stride_token,
    host_stride_head,
    dev_index_ptr,
    host_index_ptr,
    n_tokens,
    layer_begin,
    layer_count,
    layer_total,
    token_blocks,
    layer_blocks,
    tile_tokens,
    n_tiles,
    pace_ns,
    CHUNK: tl.constexpr,
    CHUNKS_PER_ROW: tl.constexpr,
    CHUNKS_PER_HEAD: tl.constexpr,
    ALIGN: tl.constexpr,
    PAGE: tl.constexpr,
    TOKENS: tl.constexpr,
    LAYERS: tl.constexpr,
    SLOTS: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr,
    TO_HOST: tl.constexpr,
    PACED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Copy every tile ``program_id, program_id + num_programs, ...`` from one side to the other.

    Software-pipelined by one tile: the loads of the next tile are issued before the stores of
    the current one, so two tiles per program are in flight across the PCIe round trip. When
    ``PACED``, a program that is ahead of ``pace_ns`` nanoseconds per tile waits on the GPU
    timer before its next tile, which caps the launch's share of the link. With ``PDL``
    (programmatic dependent launch) the launch may start while the previous kernel on the
    stream finishes, and waits for it to complete before touching any memory; it lets the next
    one start when its programs reach their last tile.
    """
    if PDL:
        gdc_wait()
    dev_at, host_at, mask = _tile_addresses(
        tl.program_id(0),
        dev_ptr,
        dev_offsets_ptr,
        dev_token_stride,
        host_ptr,
        host_stride_kv,
        host_stride_layer,
        host_stride_page,
        host_stride_token,
        host_stride_head,
        dev_index_ptr,
        host_index_ptr,
        n_tokens,
        layer_begin,
        layer_count,
        layer_total,
        token_blocks,
        layer_blocks,
        tile_tokens,
        CHUNK,
        CHUNKS_PER_ROW,
        CHUNKS_PER_HEAD,
        ALIGN,
        PAGE,
        TOKENS,
        LAYERS,
        SLOTS,
        TOKEN_MAJOR,
    )
    if TO_HOST:
        data = tl.load(dev_at, mask=mask)
        dst = host_at
    else:
        data = tl.load(host_at, mask=mask)
        dst = dev_at
    if PACED:
        due = _nanoseconds()
    for tile in range(tl.program_id(0) + tl.num_programs(0), n_tiles, tl.num_programs(0)):
        next_dev, next_host, next_mask = _tile_addresses(
            tile,
            dev_ptr,
            dev_offsets_ptr,
            dev_token_stride,
            host_ptr,
            host_stride_kv,
            host_stride_layer,
            host_stride_page,
            host_stride_token,
            host_stride_head,
            dev_index_ptr,
            host_index_ptr,
            n_tokens,
            layer_begin,
            layer_count,
            layer_total,
            token_blocks,
            layer_blocks,
            tile_tokens,
            CHUNK,
            CHUNKS_PER_ROW,
            CHUNKS_PER_HEAD,
            ALIGN,
            PAGE,
            TOKENS,
            LAYERS,
            SLOTS,
            TOKEN_MAJOR,
        )
        if PACED:
            due += pace_ns
            now = _nanoseconds()
            while now < due:
                now = _nanoseconds()
        if TO_HOST:
            next_data = tl.load(next_dev, mask=next_mask)
            next_dst = next_host
        else:
            next_data = tl.load(next_host, mask=next_mask)
            next_dst = next_dev
        tl.store(dst, data, mask=mask)
        data, dst, mask = next_data, next_dst, next_mask
    if PDL:
        gdc_launch_dependents()
    tl.store(dst, data, mask=mask)


@dataclass(frozen=True)
class TileShape:
    """How one tile covers the (token, layer, chunk) rows of a launch.

    A tile is ``tokens`` tokens by ``layers`` layers of one K/V half, every chunk of each row,
    padded to ``slots`` (a power of two) chunks. Token-major tiles walk the layers of a token
    before the next token, and consecutive tiles the layer blocks before the token blocks; the
    order is picked to follow the host buffer's memory order, so a program's writes or reads over
    PCIe land in long runs when the index list is page-contiguous.
    """

    token_major: bool
    tokens: int
    layers: int
    slots: int


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a (device pool, host view) pair that a launch needs, computed once."""

    dev_tensor: torch.Tensor
    dev_offsets: torch.Tensor
    dev_token_stride: int
    host_tensor: torch.Tensor
    host_strides: tuple[int, int, int, int, int]
    page_size: int
    num_kv: int
    layer_num: int
    word_bytes: int
    chunk: int
    chunks_per_row: int
    chunks_per_head: int
    align: int
    num_warps: int
    balance_rounds: int
    per_layer: TileShape
    all_layers: TileShape


def _words(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """View the storage of ``tensor`` from its first element on as a flat tensor of words.

    Handing the kernel a pointer already of the word type (rather than casting inside it) keeps
    Triton's knowledge that the pointer is 16-byte aligned, which it needs to emit 16-byte loads
    and stores.
    """
    storage = tensor.untyped_storage()
    first = tensor.data_ptr() - storage.data_ptr()
    flat = torch.empty(0, dtype=_WORD_TYPE[word], device=tensor.device)
    flat.set_(storage, first // word, ((storage.nbytes() - first) // word,), (1,))
    return flat


def _largest_pow2_divisor(value: int) -> int:
    return value & -value if value else 1 << 62


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _tile_shape(host: HostView, layer_count: int, chunks_per_row: int, target: int) -> TileShape:
    """Pick a tile of about ``target`` chunks whose walk follows the host memory order."""
    layers = 1
    if layer_count == 1:
        token_major = False
    elif host.stride_layer < host.stride_token:
        # page_first-like: a token's layers are adjacent; take as many whole layers per token as
        # fit, balanced so the last layer block is not mostly empty.
        token_major = True
        best = 0.0
        for count in range(1, layer_count + 1):
            per_token = count * chunks_per_row
            if per_token > target:
                break
            filled = (target // per_token) * per_token / target
            blocks = -(-layer_count // count)
            score = filled * layer_count / (blocks * count)
            if score >= best:
                best, layers = score, count
    else:
        # page_first_direct-like tiles walk a page's layers in turn; layer_first-like walk tokens.
        token_major = host.stride_layer < host.stride_page
    tokens = max(1, target // (layers * chunks_per_row))
    return TileShape(token_major, tokens, layers, _next_pow2(tokens * layers * chunks_per_row))


def plan_transfer(device: DevicePool, host: HostView, config: KernelConfig) -> LaunchPlan:
    """Choose the word size, chunking, tiling and alignment hints for two pools."""
    element = device.dtype.itemsize
    pointers = [t.data_ptr() for part in device.buffers for t in part]
    # The host side copies contiguous segments: whole rows, or single heads when they are apart.
    split = not host.rows_contiguous
    segment_nbytes = host.head_elems * element if split else device.row_nbytes
    strides = (
        host.stride_kv,
        host.stride_layer,
        host.stride_page,
        host.stride_token,
        host.head_stride if split else 0,
    )
    byte_quantities = [
        device.row_nbytes,
        segment_nbytes,
        device.token_stride * element,
        host.buffer.data_ptr(),
        *(s * element for s in strides),
        *pointers,
    ]
    word = min(8, *(_largest_pow2_divisor(q) for q in byte_quantities))
    row_words = device.row_nbytes // word
    segment_words = segment_nbytes // word
    chunk = min(_largest_pow2_divisor(segment_words), max(1, config.max_chunk_bytes // word))
    chunks_per_row = row_words // chunk
    base = pointers[0]
    offsets = [(p - base) // word for p in pointers]
    kv, layer, page, token, head = (s * element // word for s in strides)
    page_size = host.page_size
    if host.stride_page == page_size * host.stride_token:
        # Pages are just runs of tokens (layer_first, page_first): address slots directly, which
        # saves the division and one kernel variant per page size.
        page_size, page = 1, token
    align = chunk
    dev_token_stride = device.token_stride * element // word
    for quantity in (dev_token_stride, kv, layer, page, token, head, *offsets):
        align = math.gcd(align, quantity)
    target = _next_pow2(max(1, config.tile_bytes // (chunk * word)))
    return LaunchPlan(
        dev_tensor=_words(device.buffers[0][0], word),
        dev_offsets=torch.tensor(
            [o // align for o in offsets], dtype=torch.int64, device=device.device
        ),
        dev_token_stride=dev_token_stride // align,
        host_tensor=_words(host.buffer, word),
        host_strides=(kv // align, layer // align, page // align, token // align, head // align),
        page_size=page_size,
        num_kv=device.num_kv,
        layer_num=device.layer_num,
        word_bytes=word,
        chunk=chunk,
        chunks_per_row=chunks_per_row,
        chunks_per_head=segment_words // chunk,
        align=align,
        num_warps=config.num_warps,
        balance_rounds=config.balance_rounds,
        per_layer=_tile_shape(host, 1, chunks_per_row, target),
        all_layers=_tile_shape(host, device.layer_num, chunks_per_row, target),
    )


def split_tokens(
    n_tokens: int, tokens: int, units: int, programs: int, balance_rounds: int = 4
) -> int:
    """Tokens per tile for ``n_tokens`` tokens in tiles of at most ``tokens``.

    There are ``units`` tiles per token block (K/V halves times layer blocks), dealt to
    ``programs`` programs in rounds. A launch of at most ``balance_rounds`` rounds is as slow as
    its busiest program, so when its last round would be part-empty the tokens are cut into
    smaller tiles that fill the rounds; the busiest program never gets more tokens than before.
    """
    n_tiles = units * -(-n_tokens // tokens)
    rounds = -(-n_tiles // programs)
    if not 1 < rounds <= balance_rounds or n_tiles % programs == 0:
        return tokens
    blocks = rounds * programs // units
    if blocks * units <= n_tiles:
        return tokens
    return -(-n_tokens // blocks)


def pace_nanoseconds(tile_nbytes: int, programs: int, max_gbps: float) -> int:
    """Nanoseconds each of ``programs`` programs spends per tile for ``max_gbps`` in all."""
    return max(1, round(tile_nbytes * programs / max_gbps))


def launch(
    plan: LaunchPlan,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    to_host: bool,
    layer_begin: int,
    layer_count: int,
    programs: int,
    max_gbps: float | None = None,
    pdl: bool = False,
) -> None:
    """Launch one copy of ``layer_count`` layers from ``layer_begin`` on at most ``programs`` CTAs.

    ``device_indices`` and ``host_indices`` must be int64 tensors on the kernel's device.
    ``max_gbps`` paces the launch to about that many GB/s (see :class:`KVTransfer`); ``pdl``
    launches it with programmatic dependent launch (Hopper and later).
    """
    n_tokens = int(device_indices.numel())
    if n_tokens == 0:
        return
    shape = plan.all_layers if layer_count == plan.layer_num > 1 else plan.per_layer
    tokens = _next_pow2(n_tokens)
    layers = min(layer_count, shape.tokens // tokens)
    if shape.layers == 1 and layers > 1:
        # Few tokens: fill the tile with more layers instead of leaving most of it masked off,
        # which would cut the bytes each program keeps in flight.
        slots = _next_pow2(tokens * layers * plan.chunks_per_row)
        shape = TileShape(shape.token_major, tokens, layers, slots)
    layer_blocks = triton.cdiv(layer_count, shape.layers)
    units = plan.num_kv * layer_blocks
    tile_tokens = split_tokens(n_tokens, shape.tokens, units, programs, plan.balance_rounds)
    token_blocks = triton.cdiv(n_tokens, tile_tokens)
    n_tiles = units * token_blocks
    grid = max(1, min(programs, n_tiles))
    pace_ns = 0
    if max_gbps is not None:
        row_nbytes = plan.chunks_per_row * plan.chunk * plan.word_bytes
        pace_ns = pace_nanoseconds(tile_tokens * shape.layers * row_nbytes, grid, max_gbps)
    kernel: Any = _transfer_kernel[(grid,)]
    kernel(
        plan.dev_tensor,
        plan.dev_offsets,
        plan.dev_token_stride,
        plan.host_tensor,
        *plan.host_strides,
        device_indices,
        host_indices,
        n_tokens,
        layer_begin,
        layer_count,
        plan.layer_num,
        token_blocks,
        layer_blocks,
        tile_tokens,
        n_tiles,
        pace_ns,
        CHUNK=plan.chunk,
        CHUNKS_PER_ROW=plan.chunks_per_row,
        CHUNKS_PER_HEAD=plan.chunks_per_head,
        ALIGN=plan.align,
        PAGE=plan.page_size,
        TOKENS=shape.tokens,
        LAYERS=shape.layers,
        SLOTS=shape.slots,
        TOKEN_MAJOR=shape.token_major,
        TO_HOST=to_host,
        PACED=pace_ns > 0,
        PDL=pdl,
        num_warps=plan.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
