"""Transfer kernels that move KV pages between device and host pools.

:class:`KVTransfer` is the entry point: it binds a layer-first :class:`DevicePool` to a host pool
(or any :class:`HostView`) and copies listed token slots in either direction, one layer or all
layers per launch, on a bounded number of SMs. The Triton kernel lives in
``hicache_storage.kernels.triton_kernels`` (imported only when used) and the torch reference, also
the CPU fallback, in :func:`transfer_reference`.
"""

from __future__ import annotations

from hicache_storage.kernels.dispatch import (
    Backend,
    CopyFence,
    Indices,
    KernelConfig,
    KVTransfer,
)
from hicache_storage.kernels.pools import DevicePool, HostView
from hicache_storage.kernels.reference import transfer_reference

__all__ = [
    "Backend",
    "CopyFence",
    "DevicePool",
    "HostView",
    "Indices",
    "KVTransfer",
    "KernelConfig",
    "transfer_reference",
]
