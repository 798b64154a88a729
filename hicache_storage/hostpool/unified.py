"""A host pool seen through the unified key scheme: every object of every page is one "page".

Under the unified scheme a rank stores several objects per page (one per layer chunk and head
group) and an object's bytes are in a canonical order that does not depend on the host layout
(:data:`~hicache_storage.keys.unified.OBJECT_LAYOUTS`). :class:`UnifiedObjectPool` wraps a
:class:`~hicache_storage.hostpool.pool.HostKVPool` and answers the
:class:`~hicache_storage.backend.HostPool` protocol for those objects, so every backend's
``batch_get_v1``/``batch_set_v1`` moves unified objects unchanged::

    objects = UnifiedObjectPool(pool, plan)
    backend.register_host_pool(objects)
    backend.batch_set_v1(plan.keys(page_hashes), objects.object_indices(host_indices))

Object *j* of the page starting at token ``s`` is the view's page ``s // page_size * n + j``
(``n`` objects per page). Each object is described as the contiguous spans of the pool it
occupies, in object byte order: a backend that moves a list of buffers (``preadv``, registered
scatter-gather) moves it zero-copy. How many spans that takes depends on the host layout:

=====================  ====================================  ==============================
host layout            spans per MHA object (all pool heads)  with a subset of the heads
=====================  ====================================  ==============================
``page_first_direct``  2 (K, V)                              ``2 * layers * page``
``layer_first``        ``2 * layers``                        ``2 * layers * page``
``page_first``         ``2 * layers * page``                 ``2 * layers * page``
``page_head``          ``2 * layers * page * heads``         ``2 * layers * page * heads``
=====================  ====================================  ==============================

A backend that stores one contiguous value per key copies once (gathers the spans into a
temporary on write, scatters on read: :meth:`UnifiedObjectPool.read_object` and
:meth:`UnifiedObjectPool.write_object`, or the default ``batch_*_v1`` of
:class:`~hicache_storage.backend.StorageBackend`, which bounce multi-span objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.errors import BufferSizeError, HostPoolError, IndexAlignmentError
from hicache_storage.hostpool.allocator import page_ids, page_starts
from hicache_storage.hostpool.layout import Layout
from hicache_storage.hostpool.pool import HostKVPool
from hicache_storage.keys.unified import UnifiedObject, UnifiedPlan, dtype_itemsize

__all__ = ["UnifiedObjectPool"]

HostIndices: TypeAlias = torch.Tensor | Sequence[int]
Grid: TypeAlias = npt.NDArray[np.uint8]


class UnifiedObjectPool:
    """The objects of a unified-scheme plan over a host pool, as a backend's host pool.

    Parameters
    ----------
    pool
        The rank's host pool (any layout, MHA or MLA).
    plan
        The rank's plan (:func:`~hicache_storage.keys.unified.plan_unified`).

    Raises
    ------
    HostPoolError
        If the pool does not hold what the plan describes (page size, element size, MLA or not,
        layers of the stage, local KV heads).
    """

    def __init__(self, pool: HostKVPool, plan: UnifiedPlan) -> None:
        namespace = plan.namespace
        objects = plan.objects
        stage_layers = objects[-1].pool_layers.stop
        problems = []
        if pool.page_size != namespace.page_size:
            problems.append(f"page_size {pool.page_size} != {namespace.page_size}")
        if pool.kv_buffer.element_size() != dtype_itemsize(namespace.dtype):
            problems.append(
                f"{pool.kv_buffer.element_size()}-byte elements cannot hold {namespace.dtype}"
            )
        if pool.is_mla != namespace.rank_replicated:
            problems.append("an MLA pool needs an MLA plan and an MHA pool an MHA plan")
        if pool.layer_num != stage_layers:
            problems.append(f"{pool.layer_num} pool layers != {stage_layers} layers of the stage")
        heads = max(obj.pool_heads.stop for obj in objects)
        if not pool.is_mla and getattr(pool, "head_num", None) != heads:
            problems.append(f"{getattr(pool, 'head_num', None)} pool heads != {heads} local heads")
        if problems:
            raise HostPoolError("host pool does not match the unified plan: " + "; ".join(problems))
        self.pool = pool
        self.plan = plan
        self.page_size = pool.page_size
        self.objects_per_page = len(objects)
        self.size = pool.size * self.objects_per_page
        self._bytes: Grid = pool.kv_buffer.view(torch.uint8).numpy()
        self._layer_major = namespace.object_layout == "page-unified-layer-major-v1"
        self._nbytes = [self._view(0, obj).nbytes for obj in objects]
        self.page_nbytes = max(self._nbytes)
        """Bytes of the largest object (a final, shorter layer chunk makes smaller ones)."""

    def object_nbytes(self, index: int) -> int:
        """Bytes of object ``index`` (position in ``plan.objects``) of any page."""
        return self._nbytes[index]

    def object_indices(self, host_indices: HostIndices) -> torch.Tensor:
        """Map host indices of pages to this view's indices of their objects, in key order.

        ``host_indices`` has ``page_size`` entries per page; the result has ``page_size``
        entries per object, matching ``plan.keys(page_hashes)``.

        Raises
        ------
        IndexAlignmentError
            If the indices are not whole, aligned pages of the pool.
        """
        pages = page_ids(host_indices, self.page_size, self.pool.size)
        count = self.objects_per_page
        virtual = pages[:, None] * count + torch.arange(count, dtype=torch.int64)
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (virtual[:, :, None] * self.page_size + offsets).reshape(-1)

    def page_starts(self, host_indices: HostIndices) -> list[int]:
        """Validate this view's indices and return each object's first index.

        Raises
        ------
        IndexAlignmentError
            If the indices do not describe whole, aligned, in-range objects.
        """
        return page_starts(host_indices, self.page_size, self.size)

    def page_buffer_views(self, host_indices: HostIndices) -> list[list[memoryview]]:
        """Per object, writable zero-copy views of its spans of the pool, in object byte order."""
        return [_spans(self._object(start)) for start in self.page_starts(host_indices)]

    def page_buffer_meta(self, host_indices: HostIndices) -> list[list[tuple[int, int]]]:
        """Per object, ``(address, nbytes)`` of its spans of the pool, in object byte order."""
        return [
            [(int(span.ctypes.data), span.nbytes) for span in _span_arrays(self._object(start))]
            for start in self.page_starts(host_indices)
        ]

    def read_object(self, start: int, out: object) -> None:
        """Gather the object at view index ``start`` into ``out`` (one copy).

        Raises
        ------
        BufferSizeError
            If ``out`` is not exactly the object's size.
        IndexAlignmentError
            If ``start`` is not the first index of an object.
        """
        view = self._object(self._start(start))
        np.copyto(_shaped(as_writable(out), view), view)

    def write_object(self, start: int, data: object) -> None:
        """Scatter the object bytes in ``data`` into the pool at view index ``start``.

        Raises
        ------
        BufferSizeError
            If ``data`` is not exactly the object's size.
        IndexAlignmentError
            If ``start`` is not the first index of an object.
        """
        view = self._object(self._start(start))
        np.copyto(view, _shaped(as_readable(data), view))

    def _start(self, start: int) -> int:
        if isinstance(start, bool) or not isinstance(start, int):
            raise IndexAlignmentError(f"object start must be an int, got {start!r}")
        if start % self.page_size or not 0 <= start < self.size:
            raise IndexAlignmentError(
                f"object start {start} is not a multiple of page_size ({self.page_size}) "
                f"in [0, {self.size})"
            )
        return start

    def _object(self, start: int) -> Grid:
        page, index = divmod(start // self.page_size, self.objects_per_page)
        return self._view(page, self.plan.objects[index])

    def _view(self, page: int, obj: UnifiedObject) -> Grid:
        """Strided byte view of one object in object order (last axis: a head's bytes)."""
        b, layers, ps = self._bytes, obj.pool_layers, self.page_size
        a, z, s = layers.start, layers.stop, page * ps
        layout = self.pool.layout
        view: Grid
        if self.pool.is_mla:
            if layout is Layout.LAYER_FIRST:
                view = b[a:z, s : s + ps]
            elif layout is Layout.PAGE_FIRST:
                view = b[s : s + ps, a:z].transpose(1, 0, 2, 3)
            else:
                view = b[page, a:z]
            return view
        h0, h1 = obj.pool_heads.start, obj.pool_heads.stop
        if layout is Layout.LAYER_FIRST:
            view = b[:, a:z, s : s + ps, h0:h1]
        elif layout is Layout.PAGE_FIRST:
            view = b[:, s : s + ps, a:z, h0:h1].transpose(0, 2, 1, 3, 4)
        elif layout is Layout.PAGE_HEAD:
            view = b[:, page, h0:h1, :, a:z].transpose(0, 3, 2, 1, 4)
        else:
            view = b[:, page, a:z, :, h0:h1]
        return view.transpose(1, 0, 2, 3, 4) if self._layer_major else view


def _span_arrays(view: Grid) -> list[Grid]:
    """Split a strided view into its contiguous pieces, in order (as few as its strides allow)."""
    lead = 0
    while not view[(0,) * lead].flags.c_contiguous:
        lead += 1
    return [view[index].reshape(-1) for index in np.ndindex(*view.shape[:lead])]


def _spans(view: Grid) -> list[memoryview]:
    return [span.data for span in _span_arrays(view)]


def _shaped(buffer: memoryview, view: Grid) -> Grid:
    if buffer.nbytes != view.nbytes:
        raise BufferSizeError(f"buffer holds {buffer.nbytes} bytes but the object is {view.nbytes}")
    return np.frombuffer(buffer, dtype=np.uint8).reshape(view.shape)
