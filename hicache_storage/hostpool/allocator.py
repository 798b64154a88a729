"""Page allocator of the host KV pool: hands out token slots in whole pages.

Freed pages go to a release list and are merged (concatenated and sorted) into the free list
only when an allocation needs more pages than the free list holds, so a burst of frees costs no
sorting. A used bitmap with one bit per page makes a double allocation or a double free fail
loudly, naming the page, instead of silently handing the same slots to two requests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from hicache_storage.errors import AllocatorError, HostPoolError, IndexAlignmentError
from hicache_storage.kit.options import positive_int

__all__ = ["PageAllocator", "page_ids", "page_starts"]


def _index_array(host_indices: torch.Tensor | Sequence[int]) -> npt.NDArray[np.int64]:
    """Return host indices as a 1-D int64 numpy array, rejecting anything but integers."""
    if isinstance(host_indices, torch.Tensor):
        dtype: object = host_indices.dtype
        shape = tuple(host_indices.shape)
        integer = not (
            host_indices.is_floating_point()
            or host_indices.is_complex()
            or host_indices.dtype == torch.bool
        )
        array = host_indices.detach().cpu().numpy() if integer and len(shape) == 1 else None
    else:
        try:
            array = np.asarray(host_indices)
        except ValueError as exc:
            message = f"host indices must be a flat sequence of ints: {exc}"
            raise IndexAlignmentError(message) from exc
        dtype, shape = array.dtype, array.shape
        integer = array.dtype.kind in "iu" or array.size == 0
    if len(shape) != 1 or not integer or array is None:
        raise IndexAlignmentError(
            f"host indices must be a 1-D integer tensor or sequence of ints, "
            f"got dtype {dtype} with shape {shape}"
        )
    return array.astype(np.int64, copy=False)


_LAST = threading.local()
"""Per thread, the last tensor :func:`page_starts` checked: ``(tensor, stamp, starts)``."""


def page_starts(host_indices: torch.Tensor | Sequence[int], page_size: int, size: int) -> list[int]:
    """Validate token indices of whole pages (as :func:`page_ids`); return each page's first.

    One v1 call hands the same tensor to the validation layer and then to the backend, and both
    ask the pool for its pages: each thread remembers the last tensor it checked, with the
    tensor's version counter (any in-place change, through any view, bumps it), its address,
    shape and strides, so that call converts and checks its indices once.

    Raises
    ------
    IndexAlignmentError
        If the indices are not integers, or do not describe whole, aligned, in-range pages.
    """
    stamp: tuple[object, ...] | None = None
    if isinstance(host_indices, torch.Tensor):
        stamp = (
            host_indices._version,
            host_indices.data_ptr(),
            tuple(host_indices.shape),
            host_indices.stride(),
            host_indices.dtype,
            page_size,
            size,
        )
        last = getattr(_LAST, "entry", None)
        if last is not None and last[0] is host_indices and last[1] == stamp:
            return list(last[2])
    starts = (page_ids(host_indices, page_size, size) * page_size).tolist()
    if stamp is not None:
        _LAST.entry = (host_indices, stamp, tuple(starts))
    return starts


def page_ids(host_indices: torch.Tensor | Sequence[int], page_size: int, size: int) -> torch.Tensor:
    """Validate token indices that describe whole pages and return their page numbers.

    Parameters
    ----------
    host_indices
        1-D integer tensor or sequence of token indices, ``page_size`` consecutive indices per
        page, each page starting at a multiple of ``page_size``.
    page_size, size
        Tokens per page and token slots in the pool.

    Returns
    -------
    torch.Tensor
        1-D int64 CPU tensor with one page number (start // page_size) per page, in order.

    Raises
    ------
    IndexAlignmentError
        If the indices are not integers, or do not describe whole, aligned, in-range pages.
    """
    indices = _index_array(host_indices)
    if indices.size % page_size:
        raise IndexAlignmentError(
            f"got {indices.size} host indices, not a multiple of page_size ({page_size}); "
            f"pass page_size indices per page"
        )
    pages = indices.reshape(-1, page_size)
    starts = pages[:, 0]
    bad = np.flatnonzero((starts % page_size != 0) | (starts < 0) | (starts >= size))
    if bad.size:
        i = int(bad[0])
        raise IndexAlignmentError(
            f"page {i} starts at token {int(starts[i])}, which is not a multiple of page_size "
            f"({page_size}) in [0, {size})"
        )
    broken = np.flatnonzero((pages - starts[:, None] != np.arange(page_size)).any(axis=1))
    if broken.size:
        i = int(broken[0])
        raise IndexAlignmentError(
            f"page {i} starting at token {int(starts[i])} is not {page_size} consecutive "
            f"indices: got {pages[i].tolist()}"
        )
    return torch.from_numpy(starts // page_size)


class PageAllocator:
    """Thread-safe allocator of the token slots ``[0, size)`` in pages of ``page_size``.

    Parameters
    ----------
    size
        Token slots managed; a positive multiple of ``page_size``.
    page_size
        Tokens per page; every allocation and free covers whole pages.
    """

    def __init__(self, size: int, page_size: int) -> None:
        if page_size <= 0 or size <= 0 or size % page_size:
            raise HostPoolError(
                f"size ({size}) must be a positive multiple of page_size ({page_size})"
            )
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self._lock = threading.RLock()
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._used = torch.zeros(self.num_pages, dtype=torch.bool)

    def available_size(self) -> int:
        """Token slots free now, counting pages freed but not yet merged into the free list."""
        with self._lock:
            released = sum(int(pages.numel()) for pages in self._released)
            return (int(self._free_pages.numel()) + released) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` token slots (whole pages).

        Returns
        -------
        torch.Tensor or None
            1-D int64 token indices, ``page_size`` consecutive per page; None when fewer than
            ``need_size`` slots are free.

        Raises
        ------
        IndexAlignmentError
            If ``need_size`` is not a positive multiple of ``page_size``.
        AllocatorError
            If a page handed out is already marked used (allocator state is corrupt).
        """
        positive_int("need_size", need_size, IndexAlignmentError)
        if need_size % self.page_size:
            raise IndexAlignmentError(
                f"need_size ({need_size}) must be a multiple of page_size ({self.page_size})"
            )
        num = need_size // self.page_size
        with self._lock:
            if num > self._free_pages.numel() and self._released:
                merged = torch.cat([self._free_pages, *self._released])
                self._free_pages = torch.sort(merged).values
                self._released = []
            if num > self._free_pages.numel():
                return None
            pages = self._free_pages[:num]
            taken = torch.nonzero(self._used[pages])
            if taken.numel():
                page = int(pages[int(taken[0, 0])])
                raise AllocatorError(
                    f"double allocation of page {page} (tokens {page * self.page_size}.."
                    f"{(page + 1) * self.page_size - 1}); the allocator's free list is corrupt"
                )
            self._free_pages = self._free_pages[num:]
            self._used[pages] = True
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Return whole pages of token slots to the allocator.

        Raises
        ------
        IndexAlignmentError
            If ``indices`` do not describe whole, aligned, in-range pages.
        AllocatorError
            If a page is freed twice or was never allocated.
        """
        pages = page_ids(indices, self.page_size, self.size)
        if pages.numel() == 0:
            return
        with self._lock:
            unique, counts = torch.unique(pages, return_counts=True)
            repeated = unique[counts > 1]
            if repeated.numel():
                page = int(repeated[0])
                raise AllocatorError(self._free_error(page, "appears twice in one free"))
            not_used = torch.nonzero(~self._used[pages])
            if not_used.numel():
                page = int(pages[int(not_used[0, 0])])
                raise AllocatorError(self._free_error(page, "is not allocated (double free?)"))
            self._used[pages] = False
            self._released.append(pages.clone())

    def clear(self) -> None:
        """Mark every page free, forgetting all allocations."""
        with self._lock:
            self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)
            self._released = []
            self._used.zero_()

    def _free_error(self, page: int, problem: str) -> str:
        first = page * self.page_size
        last = first + self.page_size - 1
        return f"cannot free page {page} (tokens {first}..{last}): it {problem}"
