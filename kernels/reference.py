"""Plain torch implementation of every transfer: the CPU fallback and the oracle of the tests.

It indexes the same :class:`~hicache_storage.kernels.pools.DevicePool` and
:class:`~hicache_storage.kernels.pools.HostView` as the Triton kernels, one (K/V, layer) pair at a
time, with ordinary advanced indexing, so it runs wherever torch runs and shares no addressing
code with the kernels.
"""

from __future__ import annotations

import torch

from hicache_storage.kernels.pools import DevicePool, HostView

__all__ = ["transfer_reference"]


def transfer_reference(
    device: DevicePool,
    host: HostView,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    to_host: bool,
    layer: int | None = None,
) -> None:
    """Copy the listed token slots between ``device`` and ``host``.

    Parameters
    ----------
    device, host
        The two pools; they must hold matching rows (:meth:`HostView.check_matches`).
    device_indices, host_indices
        1-D integer tensors of equal length: token ``i`` moves between device slot
        ``device_indices[i]`` and host slot ``host_indices[i]``.
    to_host
        True copies device → host (backup), False host → device (load).
    layer
        One layer to copy, or None for every layer.
    """
    layers = range(device.layer_num) if layer is None else range(layer, layer + 1)
    dev_idx = device_indices.to(device.device, torch.int64)
    slots = host_indices.to(host.buffer.device, torch.int64)
    page, offset = slots // host.page_size, slots % host.page_size
    host_rows = host.rows()
    for kv in range(device.num_kv):
        for index in layers:
            dev_rows = device.rows(kv, index).view(device.size, host.head_num, host.head_elems)
            if to_host:
                host_rows[kv, index][page, offset] = dev_rows[dev_idx].to(host.buffer.device)
            else:
                dev_rows[dev_idx] = host_rows[kv, index][page, offset].to(device.device)
