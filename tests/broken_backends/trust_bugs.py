"""A backend whose answers cannot be trusted: the engine's end-to-end check must catch it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import Bug, bug
from .dict_bugs import DictBackend

__all__ = ["BUGS", "ClaimsUnfilled"]


class ClaimsUnfilled(DictBackend):
    """Bug: a v1 read answers ``True`` for every stored page without filling its slots.

    What a lost RDMA completion, or a read that gave up and forgot to say so, looks like.
    """

    name = "broken-claims-unfilled"

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        return [self._lookup(key) is not None for key in keys]


_M = __name__
BUGS: list[Bug] = [
    bug(
        "broken-claims-unfilled",
        f"{_M}:ClaimsUnfilled",
        "batch_get_v1 answers True for stored pages without filling the slots",
        "TestEndToEnd::test_v1_hits_are_verified_written_pages",
    ),
]
