"""The two sides of a KV transfer: the layer-first device pool and a stride view of a host buffer.

A transfer moves *rows*: the K (or V, or MLA latent) data of one token slot in one layer, ``H * D``
elements. On the device, row ``(kv, layer, slot)`` lives, contiguous, in that layer's K or V
tensor at ``slot * token_stride``. On the host, :class:`HostView` places each head of it by five
strides and a page size, which covers every layout of :mod:`hicache_storage.hostpool` and any
other buffer whose heads are contiguous::

    offset(kv, layer, slot, head) = kv * stride_kv + layer * stride_layer
        + (slot // page_size) * stride_page + (slot % page_size) * stride_token
        + head * stride_head

so the kernels need no particular host layout. In every layout but ``page_head`` a row's heads
are packed (``stride_head`` is ``D``, the row is contiguous); under ``page_head`` they are a page's
worth of tokens and layers apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_storage.errors import HostPoolError, InvalidValueError
from hicache_storage.hostpool import HostKVPool, Layout

__all__ = ["DevicePool", "HostView"]


def _row_elems(row_shape: tuple[int, ...]) -> int:
    return math.prod(row_shape)


def _check_row_contiguous(tensor: torch.Tensor, what: str) -> None:
    """Raise unless the trailing (head, dim) axes of ``tensor`` are packed C-contiguously."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            raise HostPoolError(
                f"{what}: the row axes {tuple(tensor.shape[1:])} must be contiguous, "
                f"got strides {tensor.stride()[1:]}"
            )
        expected *= size


class DevicePool:
    """A layer-first KV pool: per layer one K and one V tensor, or one tensor for MLA.

    Every tensor must have the same shape, dtype, device and token stride, with contiguous rows.

    Parameters
    ----------
    k_buffers
        One tensor per layer, shaped ``(size, H, D)`` (MHA K) or ``(size, 1, d)`` (MLA).
    v_buffers
        The V tensors for MHA, shaped like ``k_buffers``; None for MLA.
    """

    __slots__ = ("buffers", "device", "dtype", "layer_num", "row_shape", "size", "token_stride")

    def __init__(
        self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None = None
    ) -> None:
        kv = [tuple(k_buffers)] if v_buffers is None else [tuple(k_buffers), tuple(v_buffers)]
        if not kv[0] or any(len(part) != len(kv[0]) for part in kv):
            raise HostPoolError("a device pool needs the same, non-zero number of K and V layers")
        first = kv[0][0]
        if first.dim() < 2:
            raise HostPoolError(f"device buffers must be (size, ...row), got {tuple(first.shape)}")
        for part in kv:
            for layer, tensor in enumerate(part):
                what = f"device buffer of layer {layer}"
                if (tensor.shape, tensor.dtype, tensor.device) != (
                    first.shape,
                    first.dtype,
                    first.device,
                ):
                    raise HostPoolError(
                        f"{what} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; "
                        f"expected {tuple(first.shape)} {first.dtype} on {first.device}"
                    )
                if tensor.stride(0) != first.stride(0):
                    raise HostPoolError(
                        f"{what} has token stride {tensor.stride(0)}, layer 0 has "
                        f"{first.stride(0)}; every layer must share one token stride"
                    )
                _check_row_contiguous(tensor, what)
        self.buffers: tuple[tuple[torch.Tensor, ...], ...] = tuple(kv)
        self.layer_num = len(kv[0])
        self.size = int(first.shape[0])
        self.row_shape = tuple(int(s) for s in first.shape[1:])
        self.token_stride = int(first.stride(0))
        self.dtype = first.dtype
        self.device = first.device

    @property
    def num_kv(self) -> int:
        """2 for MHA (K and V), 1 for MLA."""
        return len(self.buffers)

    @property
    def is_mla(self) -> bool:
        """Whether the pool holds one latent tensor per layer instead of K and V."""
        return len(self.buffers) == 1

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row: one token's K (or V, or latent) in one layer."""
        return _row_elems(self.row_shape) * self.dtype.itemsize

    @classmethod
    def mha(
        cls,
        size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> DevicePool:
        """Allocate (uninitialised) K and V tensors ``(size, head_num, head_dim)`` per layer."""

        def alloc() -> list[torch.Tensor]:
            shape = (size, head_num, head_dim)
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(layer_num)]

        return cls(alloc(), alloc())

    @classmethod
    def mla(
        cls,
        size: int,
        layer_num: int,
        kv_cache_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> DevicePool:
        """Allocate (uninitialised) latent tensors ``(size, 1, kv_cache_dim)`` per layer."""
        shape = (size, 1, kv_cache_dim)
        return cls([torch.empty(shape, dtype=dtype, device=device) for _ in range(layer_num)])

    def rows(self, kv: int, layer: int) -> torch.Tensor:
        """View one layer's K (kv=0), V (kv=1) or latent tensor as ``(size, row elements)``."""
        tensor = self.buffers[kv][layer]
        return tensor.as_strided((self.size, _row_elems(self.row_shape)), (self.token_stride, 1))


@dataclass(frozen=True)
class HostView:
    """Where each row of a host KV buffer lives: a tensor, five strides and a page size.

    Strides count elements of ``buffer`` from ``buffer.data_ptr()``. A row is ``row_shape``
    elements: ``row_shape[0]`` heads (1 for MLA), each of ``row_shape[1:]`` contiguous elements,
    ``stride_head`` apart; the default None packs the heads, making the whole row contiguous.
    Build one from a host pool with :meth:`from_pool`, or describe any other buffer directly (the
    kernels assume nothing more than the offset formula of this module).
    """

    buffer: torch.Tensor
    num_kv: int
    layer_num: int
    size: int
    page_size: int
    row_shape: tuple[int, ...]
    stride_kv: int
    stride_layer: int
    stride_page: int
    stride_token: int
    stride_head: int | None = None

    def __post_init__(self) -> None:
        counts = {
            "num_kv": self.num_kv,
            "layer_num": self.layer_num,
            "size": self.size,
            "page_size": self.page_size,
        }
        for name, value in counts.items():
            if value <= 0:
                raise HostPoolError(f"host view {name} must be positive, got {value}")
        if self.num_kv not in (1, 2):
            raise HostPoolError(f"host view num_kv must be 1 (MLA) or 2 (K, V), got {self.num_kv}")
        if self.size % self.page_size:
            raise HostPoolError(
                f"host view size ({self.size}) is not a multiple of page_size ({self.page_size})"
            )
        strides = (
            self.stride_kv,
            self.stride_layer,
            self.stride_page,
            self.stride_token,
            self.head_stride,
        )
        if min(strides) < 0:
            raise HostPoolError(f"host view strides must be non-negative, got {strides}")
        counts_per_axis = (
            self.num_kv,
            self.layer_num,
            self.size // self.page_size,
            self.page_size,
            self.head_num,
        )
        last = sum((n - 1) * s for n, s in zip(counts_per_axis, strides, strict=True))
        end = last + self.head_elems
        available = self.buffer.untyped_storage().nbytes() // self.buffer.element_size()
        available -= int(self.buffer.storage_offset())
        if end > available:
            raise HostPoolError(
                f"host view reaches element {end} but the buffer's storage holds {available} "
                f"from its first element"
            )

    @property
    def row_elems(self) -> int:
        """Elements in one row."""
        return _row_elems(self.row_shape)

    @property
    def head_num(self) -> int:
        """Heads in one row (its first axis; 1 for MLA)."""
        return self.row_shape[0] if self.row_shape else 1

    @property
    def head_elems(self) -> int:
        """Contiguous elements of one head of a row."""
        return _row_elems(self.row_shape[1:])

    @property
    def head_stride(self) -> int:
        """Elements from one head of a row to the next (``head_elems`` when they are packed)."""
        return self.head_elems if self.stride_head is None else self.stride_head

    @property
    def rows_contiguous(self) -> bool:
        """Whether every row is ``row_elems`` contiguous elements."""
        return self.head_num == 1 or self.head_stride == self.head_elems

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the buffer."""
        return self.buffer.dtype

    @classmethod
    def from_pool(cls, pool: HostKVPool) -> HostView:
        """Describe the ``kv_buffer`` of an MHA or MLA host pool, whatever its layout."""
        buffer = pool.kv_buffer
        # Give MLA buffers a unit K/V axis so both kinds share the MHA axis order below.
        full = buffer.unsqueeze(0) if pool.is_mla else buffer
        stride = full.stride()
        num_kv = 1 if pool.is_mla else 2
        kv_stride = 0 if pool.is_mla else stride[0]
        head: int | None = None
        row_shape: tuple[int, ...]
        if pool.layout is Layout.LAYER_FIRST:
            layer, token, row_shape = stride[1], stride[2], full.shape[3:]
            page = pool.page_size * token
        elif pool.layout is Layout.PAGE_FIRST:
            token, layer, row_shape = stride[1], stride[2], full.shape[3:]
            page = pool.page_size * token
        elif pool.layout is Layout.PAGE_FIRST_DIRECT:
            page, layer, token, row_shape = stride[1], stride[2], stride[3], full.shape[4:]
        else:  # page_head, (2, pages, H, page, L, D): a row's heads are a page of tokens apart
            page, head, token, layer = stride[1], stride[2], stride[3], stride[4]
            row_shape = (full.shape[2], full.shape[5])
        return cls(
            buffer=buffer,
            num_kv=num_kv,
            layer_num=pool.layer_num,
            size=pool.size,
            page_size=pool.page_size,
            row_shape=tuple(int(s) for s in row_shape),
            stride_kv=kv_stride,
            stride_layer=layer,
            stride_page=page,
            stride_token=token,
            stride_head=head,
        )

    def rows(self) -> torch.Tensor:
        """View the buffer as ``(num_kv, layer_num, pages, page_size, head_num, head_elems)``."""
        return self.buffer.as_strided(
            (
                self.num_kv,
                self.layer_num,
                self.size // self.page_size,
                self.page_size,
                self.head_num,
                self.head_elems,
            ),
            (
                self.stride_kv,
                self.stride_layer,
                self.stride_page,
                self.stride_token,
                self.head_stride,
                1,
            ),
        )

    def check_matches(self, device: DevicePool) -> None:
        """Raise unless this view and ``device`` hold the same kind of rows.

        Raises
        ------
        InvalidValueError
            If the dtypes differ.
        HostPoolError
            If the K/V count, layer count or row shape differ.
        """
        if self.dtype != device.dtype:
            raise InvalidValueError(
                f"host buffer is {self.dtype} but the device pool is {device.dtype}; "
                f"a transfer copies bytes and never converts"
            )
        mine = (self.num_kv, self.layer_num, self.row_elems)
        theirs = (device.num_kv, device.layer_num, _row_elems(device.row_shape))
        if mine != theirs:
            raise HostPoolError(
                f"host rows (kv, layers, elements) = {mine} do not match the device pool's {theirs}"
            )
