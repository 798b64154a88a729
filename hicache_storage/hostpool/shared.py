"""Host memory another process can map: a host pool whose pages a storage process moves itself.

A pool allocated with ``shared=True`` lives in an anonymous memory file (``memfd_create``), mapped
shared, and pinned for the GPU with ``cudaHostRegister`` when asked. Another process of the same
user maps the same pages by opening ``/proc/<pid>/fd/<fd>`` (:func:`map_region`), so a storage
backend run in its own process (the ``process`` backend) reads objects straight into the
engine's pool: no copy, and none of its threads compete for the engine's GIL. Linux only.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import weakref
from dataclasses import dataclass

import torch

from hicache_storage.errors import HostPoolError

__all__ = ["SharedRegion", "map_region", "region_of", "shared_zeros"]


@dataclass(frozen=True)
class SharedRegion:
    """Where a tensor's bytes live in shared memory: enough for another process to map them.

    Attributes
    ----------
    path
        ``/proc/<pid>/fd/<fd>`` of the owning process's memory file.
    nbytes
        Size of the whole mapping.
    offset
        Where the tensor starts within it.
    """

    path: str
    nbytes: int
    offset: int = 0


_lock = threading.Lock()
_mappings: dict[int, tuple[int, str, weakref.ref[mmap.mmap]]] = {}
"""Base address of each live mapping -> (size, path, the mapping)."""

_dead: queue.SimpleQueue[tuple[int, weakref.ref[mmap.mmap]]] = queue.SimpleQueue()
"""Mappings released since the lock was last taken, forgotten by the next holder: a release is
a finalizer, which a garbage collection may run on a thread that holds the lock (inside
:func:`shared_zeros`), so it must not wait for the lock."""


def shared_zeros(nbytes: int, *, pin: bool) -> torch.Tensor:
    """Return a zeroed ``uint8`` tensor of ``nbytes`` in shared memory, pinned if ``pin``.

    The memory is released (and unpinned) when the last tensor viewing it is gone.

    Raises
    ------
    HostPoolError
        If the platform has no ``memfd_create`` or the memory cannot be mapped or pinned.
    """
    if not hasattr(os, "memfd_create"):
        raise HostPoolError("shared host pools need Linux (os.memfd_create)")
    if nbytes <= 0:
        raise HostPoolError(f"a shared host pool needs a positive size, got {nbytes} bytes")
    try:
        fd = os.memfd_create("hicache-host-pool", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise HostPoolError(f"cannot map {nbytes} bytes of shared host memory: {exc}") from exc
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    base = tensor.data_ptr()
    if pin:
        _pin(base, nbytes)
    path = f"/proc/{os.getpid()}/fd/{fd}"
    alive = weakref.ref(mapping)
    with _lock:
        _forget_dead()  # a released mapping at this address is gone before this one is named
        _mappings[base] = (nbytes, path, alive)
    weakref.finalize(mapping, _release, base, fd, pin, alive)
    return tensor


def region_of(tensor: torch.Tensor) -> SharedRegion | None:
    """Return where ``tensor`` lies in this process's shared memory, or None if it does not."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        _forget_dead()
        for base, (nbytes, path, alive) in _mappings.items():
            if base <= start and end <= base + nbytes and alive() is not None:
                return SharedRegion(path, nbytes, start - base)
    return None


def map_region(region: SharedRegion) -> torch.Tensor:
    """Map ``region`` (from another process) and return its bytes as a ``uint8`` tensor.

    Raises
    ------
    HostPoolError
        If the owning process or its memory file is gone, or the sizes disagree.
    """
    try:
        with open(region.path, "r+b") as file:
            if os.fstat(file.fileno()).st_size != region.nbytes:
                raise HostPoolError(f"shared host memory {region.path} changed size")
            mapping = mmap.mmap(file.fileno(), region.nbytes, mmap.MAP_SHARED)
    except OSError as exc:
        raise HostPoolError(f"cannot map shared host memory {region.path}: {exc}") from exc
    return torch.frombuffer(mapping, dtype=torch.uint8)[region.offset :]


def _pin(base: int, nbytes: int) -> None:
    if not torch.cuda.is_available():
        raise HostPoolError("pinning a shared host pool needs CUDA; pass pin_memory=False")
    code = torch.cuda.cudart().cudaHostRegister(base, nbytes, 0)  # type: ignore[no-untyped-call]
    if int(code) != 0:
        raise HostPoolError(f"cudaHostRegister of {nbytes} bytes failed (error {int(code)})")


def _forget_dead() -> None:
    """Drop the released mappings from :data:`_mappings` (the caller holds :data:`_lock`)."""
    while True:
        try:
            base, alive = _dead.get_nowait()
        except queue.Empty:
            return
        entry = _mappings.get(base)
        if entry is not None and entry[2] is alive:
            del _mappings[base]


def _release(base: int, fd: int, pinned: bool, alive: weakref.ref[mmap.mmap]) -> None:
    _dead.put((base, alive))
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(base)  # type: ignore[no-untyped-call]
    os.close(fd)
