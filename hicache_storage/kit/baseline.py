"""The raw baseline ``hicache bench`` measures a backend against.

A baseline moves the same bytes over the same medium with nothing on top: plain client calls,
no validation, no atomic publish, no index. ``hicache bench`` reports the backend's throughput
as a ratio of the baseline's, so a ratio near 1.0 says the backend's guarantees cost little.
Point :attr:`BackendSpec.baseline <hicache_storage.registry.BackendSpec.baseline>` at the class
(``"my_pkg.baseline:RawBaseline"``); it is built like the backend, from the parsed config and
the deployment.

Example
-------
A baseline over a dict-like client::

    class RawBaseline:
        def __init__(self, config: MyConfig, deployment: Deployment | None = None) -> None:
            self.client = connect(config.url)

        def batch_write(self, names, values):
            for name, value in zip(names, values, strict=True):
                self.client.put(name, bytes(value))

        def batch_read(self, names, outs):
            for name, out in zip(names, outs, strict=True):
                out[:] = self.client.get(name)

        def close(self):
            self.client.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from hicache_storage.backend import HostPool

__all__ = ["V1_CALLS", "Baseline", "PageBaseline"]

V1_CALLS = ("register_host_pool", "batch_write_v1", "batch_read_v1")
"""What a baseline defines to be measured against the v1 (host-pool) calls too."""


@runtime_checkable
class Baseline(Protocol):
    """Plain writes and reads of named values; what ``hicache bench --mode copy`` compares."""

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Store each value under its name, replacing any earlier one."""
        ...

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Read each named value into its buffer (exactly its size); raise if one is missing."""
        ...

    def close(self) -> None:
        """Release the client and remove what the baseline wrote, if it can."""
        ...


@runtime_checkable
class PageBaseline(Baseline, Protocol):
    """A baseline that also moves host-pool pages: what ``hicache bench --mode v1`` compares."""

    def register_host_pool(self, pool: HostPool) -> None:
        """Take the pool whose pages the v1 calls move."""
        ...

    def batch_write_v1(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> None:
        """Store each page (``host_indices`` as for ``batch_set_v1``) under its name."""
        ...

    def batch_read_v1(
        self, names: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> None:
        """Read each named page into the pool."""
        ...
