"""When the ``adaptive`` policy leaves a store alone: it fails, or it reads far slower than compute.

Such a store serves no fetch (each would be priced out), yet asking it costs every request an
existence query and its bookkeeping, and writing to it costs host room, the writer's share of
the cores and the store's bandwidth, for pages nobody will read. So while it is bypassed nothing
is asked or written (:meth:`AdaptiveDecisions.bypass
<hicache_storage.engine.fetch_decisions.AdaptiveDecisions.bypass>`), and the writes not made are
counted with the reason (:class:`Bypass`).

Both reasons come from the measured read rate (:class:`~hicache_storage.planner.rates.CostModel`),
which is forgotten :data:`~hicache_storage.planner.rates.READ_TTL_S` after the last call that
measured it: the next fetch or write then measures the store again, so neither a slow spell nor
an outage turns storage off for good.
"""

from __future__ import annotations

import enum

from hicache_storage.planner.rates import CostModel

__all__ = ["BYPASS_FACTOR", "Bypass", "bypass"]

BYPASS_FACTOR = 4.0
"""How many times slower than recomputing a page the store must read one back before the
``adaptive`` policy stops asking it and writing to it. Above one, so that a store near the
break-even, whose pages pay once the read queue is short or the batch is large, stays in use."""


class Bypass(enum.Enum):
    """Why a store is left alone."""

    SLOW = "slow"
    """Its pages read back :data:`BYPASS_FACTOR` times slower than recomputing them."""
    FAILING = "failing"
    """Its recent calls delivered nothing (failed, timed out or missed every page)."""


def bypass(costs: CostModel, page_size: int, in_flight_s_per_page: float) -> Bypass | None:
    """Return why a store should be left alone now, or None to use it.

    A store whose recent calls delivered nothing (:attr:`CostModel.failing
    <hicache_storage.planner.rates.CostModel.failing>`) is failing whatever computing costs: a
    call that failed after its deadline delivered no page in that time. Otherwise the rate is
    the measured one, or before any read has returned, the first read in flight so far
    (``in_flight_s_per_page``; one slow call among measured fast ones bypasses nothing), against
    recomputing a page for the batch. Measured on two cores with a store made slow (1 s a read):
    the scheduler thread's time beyond the host-only cache's fell from 24-45 to 2-24 ms a run.
    """
    if costs.failing:
        return Bypass.FAILING
    recompute = costs.recompute_cost_s(page_size)
    per_page = costs.read_s_per_page
    if per_page is None:  # unmeasured: the first read in flight is the evidence
        per_page = in_flight_s_per_page
    if recompute is not None and per_page > BYPASS_FACTOR * recompute:
        return Bypass.SLOW
    return None
