"""Host KV pools (L2): one CPU tensor of KV pages, pinned when CUDA is available.

A storage backend moves KV data one page at a time; a page is the *object* stored under one key.
Its bytes are the concatenation, in a canonical order, of the contiguous regions the page
occupies in the pool tensor (shapes in :mod:`hicache_storage.hostpool.layout`), so **the bytes
of an object depend on the layout**:

======================  ========================================  ======================
pool and layout         regions of one page, in order             object bytes
======================  ========================================  ======================
MHA layer_first         K layer 0..L-1, then V layer 0..L-1 (2L)  ``(2, L, page, H, D)``
MHA page_first          K page, then V page (2)                   ``(2, page, L, H, D)``
MHA page_first_direct   K page, then V page (2)                   ``(2, L, page, H, D)``
MHA page_head           K page, then V page (2)                   ``(2, H, page, L, D)``
MLA layer_first         layer 0..L-1 (L)                          ``(L, page, d)``
MLA page_first          the page (1)                              ``(page, L, d)``
MLA page_first_direct   the page (1)                              ``(L, page, d)``
======================  ========================================  ======================

A backend may move the regions zero-copy (:meth:`HostKVPool.page_buffer_meta`,
:meth:`HostKVPool.page_buffer_views`) or one contiguous value per key
(:meth:`HostKVPool.read_page`, :meth:`HostKVPool.write_page`); both give the same object bytes.
Objects written from a pool of one layout cannot be read into a pool of another.

A pool either allocates its tensor or adopts one that another engine already holds, in place
(:meth:`HostKVPool.from_buffer`).

Internally the pool tensor is seen as a byte grid with one row per region above (2L, 2, L or 1
rows), each row holding that region for every token; a page is one column range of the grid.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import Self

from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.errors import (
    BufferSizeError,
    HostPoolError,
    IndexAlignmentError,
    InvalidValueError,
)
from hicache_storage.hostpool.allocator import PageAllocator, page_starts
from hicache_storage.hostpool.layout import (
    Layout,
    mha_buffer_geometry,
    mha_buffer_shape,
    mha_page_shape,
    mla_buffer_geometry,
    mla_buffer_shape,
    mla_page_shape,
)
from hicache_storage.hostpool.shared import shared_zeros

__all__ = ["HostKVPool", "MHAHostPool", "MLAHostPool"]

HostIndices: TypeAlias = torch.Tensor | Sequence[int]


class HostKVPool:
    """A host KV cache pool: a page allocator over one ``kv_buffer`` tensor.

    Use :class:`MHAHostPool` or :class:`MLAHostPool`; this base class holds what they share.

    Parameters
    ----------
    kv_buffer
        The pool tensor, contiguous on the CPU, shaped for ``layout``.
    size, page_size, layer_num, layout
        As in the subclasses.
    rows
        Contiguous regions of one page in the pool tensor: 2 (K and V) or 1 (MLA), times
        ``layer_num`` for ``layer_first``.
    page_shape
        Shape of one page object.
    """

    is_mla: ClassVar[bool] = False

    def __init__(
        self,
        kv_buffer: torch.Tensor,
        *,
        size: int,
        page_size: int,
        layer_num: int,
        layout: Layout,
        rows: int,
        page_shape: tuple[int, ...],
    ) -> None:
        self.kv_buffer = kv_buffer
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.layer_num = layer_num
        self.dtype = kv_buffer.dtype
        self.layout = layout
        self.page_shape = page_shape
        self.base_ptr = kv_buffer.data_ptr()
        self.allocator = PageAllocator(size, page_size)
        self._rows = rows
        # Bytes of one token within one region row; a page is page_size consecutive tokens.
        self._token_nbytes = kv_buffer.numel() * kv_buffer.element_size() // (rows * size)
        self._region_nbytes = page_size * self._token_nbytes
        self._row_nbytes = size * self._token_nbytes
        self.page_nbytes = rows * self._region_nbytes
        self._grid = kv_buffer.detach().view(-1).view(torch.uint8).view(rows, self._row_nbytes)
        self._grid_np: npt.NDArray[np.uint8] = self._grid.numpy()

    @classmethod
    def from_buffer(cls, kv_buffer: torch.Tensor, page_size: int, layout: Layout | str) -> Self:
        """Make a pool over an existing tensor, in place: no copy, writes show on both sides.

        The geometry comes from the tensor's shape, which must be that of ``layout``, of any
        dtype. MHA: ``layer_first`` ``(2, L, size, H, D)``, ``page_first`` ``(2, size, L, H, D)``,
        ``page_first_direct`` ``(2, pages, L, page_size, H, D)`` or ``page_head``
        ``(2, pages, H, page_size, L, D)``. MLA: ``layer_first`` ``(L, size, 1, d)``,
        ``page_first`` ``(size, L, 1, d)`` or ``page_first_direct`` ``(pages, L, page_size, 1,
        d)``. The pool's allocator starts with every page free, whatever the tensor holds.

        Parameters
        ----------
        kv_buffer
            A contiguous CPU tensor, pinned or not; it becomes ``kv_buffer`` of the pool.
        page_size
            Tokens per page.
        layout
            A :class:`Layout` or its name (MLA: not ``page_head``).

        Returns
        -------
        HostKVPool
            A pool of the class it is called on; its ``kv_buffer`` is ``kv_buffer`` itself.

        Raises
        ------
        HostPoolError
            If ``kv_buffer`` is not a contiguous CPU tensor, its shape is not one of ``layout``
            with pages of ``page_size`` tokens, or the layout is ``page_head`` for MLA.
        """
        pool = cls.__new__(cls)
        pool._adopt(kv_buffer, page_size, Layout.parse(layout))
        return pool

    def _adopt(self, kv_buffer: torch.Tensor, page_size: int, layout: Layout) -> None:
        """Become the pool over ``kv_buffer`` (each subclass reads its own geometry)."""
        raise NotImplementedError

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` token slots; see :meth:`PageAllocator.alloc`."""
        return self.allocator.alloc(need_size)

    def free(self, indices: HostIndices) -> None:
        """Free whole pages of token slots; see :meth:`PageAllocator.free`."""
        self.allocator.free(indices)

    def page_starts(self, host_indices: HostIndices) -> list[int]:
        """Validate token indices, ``page_size`` consecutive per page, and return page starts.

        Raises
        ------
        IndexAlignmentError
            If the indices do not describe whole, aligned, in-range pages.
        """
        return page_starts(host_indices, self.page_size, self.size)

    def page_buffer_meta(self, host_indices: HostIndices) -> list[list[tuple[int, int]]]:
        """Per page, the ``(address, nbytes)`` of each region, in canonical object order."""
        nbytes = self._region_nbytes
        return [
            [
                (self.base_ptr + row * self._row_nbytes + start * self._token_nbytes, nbytes)
                for row in range(self._rows)
            ]
            for start in self.page_starts(host_indices)
        ]

    def page_buffer_views(self, host_indices: HostIndices) -> list[list[memoryview]]:
        """Per page, writable zero-copy byte views of each region, in canonical object order."""
        views = []
        for start in self.page_starts(host_indices):
            first = start * self._token_nbytes
            page = self._grid_np[:, first : first + self._region_nbytes]
            views.append([memoryview(page[row]) for row in range(self._rows)])
        return views

    def read_page(self, page_start: int, out: object) -> None:
        """Copy the object bytes of the page at ``page_start`` into ``out``.

        Raises
        ------
        InvalidValueError
            If ``out`` is not a writable, C-contiguous buffer.
        BufferSizeError
            If ``out`` is not exactly ``page_nbytes`` long.
        """
        np.copyto(self._as_grid(out, writable=True), self._grid_np[:, self._columns(page_start)])

    def write_page(self, page_start: int, data: object) -> None:
        """Scatter the object bytes in ``data`` into the page at ``page_start``.

        Raises
        ------
        InvalidValueError
            If ``data`` is not a C-contiguous buffer.
        BufferSizeError
            If ``data`` is not exactly ``page_nbytes`` long.
        """
        np.copyto(self._grid_np[:, self._columns(page_start)], self._as_grid(data, writable=False))

    def get_data_page(self, page_start: int) -> torch.Tensor:
        """Return a contiguous copy of the page at ``page_start``, shaped as its object."""
        page = self._grid[:, self._columns(page_start)].clone(memory_format=torch.contiguous_format)
        return page.view(self.dtype).view(self.page_shape)

    def set_data_page(self, page_start: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (the page object, flat or shaped, of the pool's dtype) into a page.

        Raises
        ------
        InvalidValueError
            If ``tensor`` is not a tensor of the pool's dtype.
        BufferSizeError
            If ``tensor`` does not hold exactly one page object.
        """
        columns = self._columns(page_start)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise InvalidValueError(f"expected a tensor of dtype {self.dtype}, got {got}")
        if tensor.numel() * tensor.element_size() != self.page_nbytes:
            raise BufferSizeError(
                f"tensor of shape {tuple(tensor.shape)} is not one page object {self.page_shape}"
            )
        flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        self._grid[:, columns].copy_(flat.view(self._rows, self._region_nbytes))

    def _columns(self, page_start: int) -> slice:
        """Byte columns of the page at ``page_start`` in every row of the grid."""
        try:
            start = operator.index(page_start)
        except TypeError as exc:
            raise IndexAlignmentError(f"page_start must be an int, got {page_start!r}") from exc
        if start % self.page_size or not 0 <= start < self.size:
            raise IndexAlignmentError(
                f"page_start {start} is not a multiple of page_size ({self.page_size}) "
                f"in [0, {self.size})"
            )
        first = start * self._token_nbytes
        return slice(first, first + self._region_nbytes)

    def _as_grid(self, buffer: object, *, writable: bool) -> npt.NDArray[np.uint8]:
        """View a caller's page-sized buffer as the (rows, region bytes) grid of one page."""
        view = as_writable(buffer) if writable else as_readable(buffer)
        if view.nbytes != self.page_nbytes:
            raise BufferSizeError(
                f"buffer holds {view.nbytes} bytes but one page object is {self.page_nbytes}"
            )
        return np.frombuffer(view, dtype=np.uint8).reshape(self._rows, self._region_nbytes)


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool | None, shared: bool
) -> torch.Tensor:
    """Allocate a zeroed pool tensor, pinned as asked (None: when CUDA is available)."""
    if not isinstance(dtype, torch.dtype):
        raise HostPoolError(f"dtype must be a torch.dtype, got {dtype!r}")
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    if shared:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return shared_zeros(nbytes, pin=pin).view(dtype).view(shape)
    try:
        return torch.zeros(shape, dtype=dtype, pin_memory=pin)
    except RuntimeError as exc:
        raise HostPoolError(
            f"cannot allocate a host pool of shape {shape} ({dtype}, pinned={pin}): "
            f"{exc}; pass pin_memory=False on machines without an accelerator"
        ) from exc


def _adoptable(kv_buffer: object, kind: str, layout: Layout) -> torch.Tensor:
    """Return ``kv_buffer`` if a pool can use it in place: a contiguous CPU tensor."""
    what = f"an {kind} {layout.value} host pool"
    if not isinstance(kv_buffer, torch.Tensor):
        raise HostPoolError(f"{what} needs a torch.Tensor, got {type(kv_buffer).__name__}")
    if kv_buffer.device.type != "cpu":
        raise HostPoolError(f"{what} needs a CPU tensor, got one on {kv_buffer.device}")
    if not kv_buffer.is_contiguous():
        raise HostPoolError(
            f"{what} needs a contiguous tensor, got shape {tuple(kv_buffer.shape)} with strides "
            f"{kv_buffer.stride()}"
        )
    return kv_buffer


class MHAHostPool(HostKVPool):
    """Host pool of multi-head attention KV: K and V, ``head_num`` heads of ``head_dim``.

    Parameters
    ----------
    size
        Token slots; a positive multiple of ``page_size``.
    page_size
        Tokens per page (the unit of allocation and of storage).
    layer_num, head_num, head_dim
        Model geometry, per rank.
    dtype
        Element type of the KV cache.
    layout
        A :class:`Layout` or its name.
    pin_memory
        Pin the pool for fast device transfers; None pins when CUDA is available.
    shared
        Allocate the pool in shared memory (:mod:`hicache_storage.hostpool.shared`), so that a
        storage backend in another process (the ``process`` backend) moves its pages in place.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        layout: Layout | str = Layout.LAYER_FIRST,
        pin_memory: bool | None = None,
        *,
        shared: bool = False,
    ) -> None:
        parsed = Layout.parse(layout)
        shape = mha_buffer_shape(parsed, size, page_size, layer_num, head_num, head_dim)
        self._adopt(_allocate(shape, dtype, pin_memory, shared), page_size, parsed)

    def _adopt(self, kv_buffer: torch.Tensor, page_size: int, layout: Layout) -> None:
        """Become the pool over ``kv_buffer``: what both constructors share."""
        tensor = _adoptable(kv_buffer, "MHA", layout)
        size, layer_num, head_num, head_dim = mha_buffer_geometry(layout, tensor.shape, page_size)
        super().__init__(
            tensor,
            size=size,
            page_size=page_size,
            layer_num=layer_num,
            layout=layout,
            rows=2 * layer_num if layout is Layout.LAYER_FIRST else 2,
            page_shape=mha_page_shape(layout, page_size, layer_num, head_num, head_dim),
        )
        self.head_num = head_num
        self.head_dim = head_dim
        self.k_buffer = tensor[0]
        self.v_buffer = tensor[1]


class MLAHostPool(HostKVPool):
    """Host pool of multi-head latent attention KV: one ``kv_cache_dim`` vector per token.

    Parameters are those of :class:`MHAHostPool`, with ``kv_cache_dim`` for the head geometry.
    The ``page_head`` layout is MHA-only and refused.
    """

    is_mla = True

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        kv_cache_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        layout: Layout | str = Layout.LAYER_FIRST,
        pin_memory: bool | None = None,
        *,
        shared: bool = False,
    ) -> None:
        parsed = Layout.parse(layout)
        shape = mla_buffer_shape(parsed, size, page_size, layer_num, kv_cache_dim)
        self._adopt(_allocate(shape, dtype, pin_memory, shared), page_size, parsed)

    def _adopt(self, kv_buffer: torch.Tensor, page_size: int, layout: Layout) -> None:
        """Become the pool over ``kv_buffer``: what both constructors share."""
        tensor = _adoptable(kv_buffer, "MLA", layout)
        size, layer_num, kv_cache_dim = mla_buffer_geometry(layout, tensor.shape, page_size)
        super().__init__(
            tensor,
            size=size,
            page_size=page_size,
            layer_num=layer_num,
            layout=layout,
            rows=layer_num if layout is Layout.LAYER_FIRST else 1,
            page_shape=mla_page_shape(layout, page_size, layer_num, kv_cache_dim),
        )
        self.kv_cache_dim = kv_cache_dim
