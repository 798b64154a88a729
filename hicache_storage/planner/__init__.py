"""The planner: what the storage tier reads, writes and waits for, decided from measured rates.

One component for every engine that drives a store (the tier engine, the SGLang adapter, the vLLM
tier). Its inputs are measured while serving, never tuned by hand:

- :mod:`~hicache_storage.planner.rates`: the store's read and write rates, its existence
  queries, and what a forward costs (:class:`CostModel`);
- :mod:`~hicache_storage.planner.fetch`: fetch or recompute (:func:`fetch_pays`,
  :func:`adaptive_wait_s`).

The package is pure Python over the standard library: it imports no backend, engine or torch, so
it is tested on simulated clocks and stores alone.
"""

from __future__ import annotations

from .fetch import FetchView, adaptive_wait_s, fetch_pays
from .rates import CostModel

__all__ = ["CostModel", "FetchView", "adaptive_wait_s", "fetch_pays"]
