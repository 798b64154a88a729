"""The planner: what the storage tier reads, writes and waits for, decided from measured rates.

One component for every engine that drives a store (the tier engine, the SGLang adapter, the vLLM
tier). Its inputs are measured while serving, never tuned by hand:

- :mod:`~hicache_storage.planner.rates`: the store's read and write rates, its existence
  queries, and what a forward costs (:class:`CostModel`);
- :mod:`~hicache_storage.planner.fetch`: fetch or recompute (:func:`fetch_pays`,
  :func:`adaptive_wait_s`);
- :mod:`~hicache_storage.planner.admission`: which pages are worth writing (:class:`AdmitAll`,
  :class:`AdmitSeen`);
- :mod:`~hicache_storage.planner.writes`: back-pressure, writes shed rather than queued in front
  of compute (:class:`WriteGate`);
- :mod:`~hicache_storage.planner.plan`: the three decisions over one set of rates, each with the
  rule that made it (:class:`Planner`), what an engine or an adapter holds.

The package is pure Python over the standard library: it imports no backend, engine or torch, so
it is tested on simulated clocks and stores alone.
"""

from __future__ import annotations

from .admission import Admission, AdmitAll, AdmitSeen
from .fetch import FetchView, adaptive_wait_s, fetch_pays
from .plan import FetchPlan, Planner, WritePlan
from .rates import CostModel
from .writes import WriteGate, WriteTicket

__all__ = [
    "AdmitAll",
    "AdmitSeen",
    "Admission",
    "CostModel",
    "FetchPlan",
    "FetchView",
    "Planner",
    "WriteGate",
    "WritePlan",
    "WriteTicket",
    "adaptive_wait_s",
    "fetch_pays",
]
