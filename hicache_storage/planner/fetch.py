"""Fetch or recompute: whether reading a request's stored pages beats computing them again.

Both sides are measured while serving (:class:`~hicache_storage.planner.rates.CostModel`): the
store's read rate, including the pages queued ahead of a fetch, against the forward time that
recomputing the pages costs every request of the batch. :func:`fetch_pays` decides before a
fetch starts; :func:`adaptive_wait_s` decides, while it runs, how long the request keeps waiting
for it (:class:`FetchView` is what it knows of one fetch at one moment).
"""

from __future__ import annotations

from dataclasses import dataclass

from .rates import CostModel

__all__ = ["FetchView", "adaptive_wait_s", "fetch_pays"]


@dataclass(frozen=True)
class FetchView:
    """What the ``adaptive`` policy knows of one prefetch at one moment.

    Attributes
    ----------
    queried
        The existence query has answered (``target_pages`` are then the hits).
    finished
        Nothing more will be read.
    target_pages
        Pages the fetch is after: the hits once known, else every page asked for.
    read_pages
        Leading pages already read.
    elapsed_s
        Seconds since the fetch began (the request has waited this long for it).
    call_s, call_pages
        Seconds the read call in flight has run and its pages (0 when none runs).
    queued_pages
        Pages of other fetches each read thread has to read before this one's.
    in_flight_s_per_page
        Seconds per page so far of the slowest read call in flight, this fetch's or another's
        (0 when none runs): a lower bound on the store's speed before any call has returned.
    """

    queried: bool
    finished: bool
    target_pages: int
    read_pages: int
    elapsed_s: float
    call_s: float = 0.0
    call_pages: int = 0
    queued_pages: float = 0.0
    in_flight_s_per_page: float = 0.0


def _fetch_eta_s(view: FetchView, costs: CostModel) -> float:
    """Seconds until the rest of the fetch has arrived, on the measured rates.

    What was never measured counts as free, but a read call in flight is at least as slow as it
    has been so far: a store that has not answered for a second is priced at a second a call,
    for this fetch's pages and for those of every fetch queued behind that call.
    """
    eta = 0.0
    if not view.queried:
        eta += max((costs.query_s or 0.0) - view.elapsed_s, 0.0)
    remaining = view.target_pages - view.read_pages
    per_page = max(costs.read_s_per_page or 0.0, view.in_flight_s_per_page)
    pending = remaining + view.queued_pages
    read = pending * per_page if pending > 0 else 0.0  # a failing store's rate is infinite
    if view.call_pages > 0:
        read = max(read, remaining / view.call_pages * view.call_s)
    return eta + read


def fetch_pays(
    pages: int,
    page_size: int,
    queued_pages: float,
    costs: CostModel,
    *,
    in_flight_s_per_page: float = 0.0,
) -> bool:
    """Whether reading ``pages`` pages (after ``queued_pages`` queued ahead) beats computing them.

    Computing them costs every request of the batch its forward time
    (:meth:`.CostModel.recompute_cost_s`); reading them delays only the request that waits.

    ``in_flight_s_per_page`` is the slowest read call in flight's seconds so far per page: a
    lower bound on the store's speed before any call has returned (a store that answers in a
    second is known to be slow long before its first answer). True while both are unmeasured:
    the first reads are how the store's speed is learnt, and :func:`adaptive_wait_s` bounds what
    a request waits for them.
    """
    recompute = costs.recompute_cost_s(pages * page_size)
    per_page = max(costs.read_s_per_page or 0.0, in_flight_s_per_page)
    if recompute is None or per_page == 0.0:
        return True
    return pages + queued_pages > 0 and (pages + queued_pages) * per_page < recompute


def adaptive_wait_s(
    view: FetchView,
    costs: CostModel,
    *,
    page_size: int,
    block_s: float,
    next_step_s: float,
) -> float | None:
    """Decide for ``adaptive``: None to schedule the request now, else the seconds to wait.

    Scheduling now costs recomputing the pages not yet read, in the forwards that every request
    of the batch waits for (:meth:`.CostModel.recompute_cost_s`); waiting costs the time until
    they have arrived, or, when that is longer than the scheduler can block (``block_s``), the
    time to the next step (``next_step_s``) as well, and delays this request alone. The request
    waits only while waiting is the cheaper, and never longer in all than recomputing every page
    it is after would cost the batch, so a slow or unmeasured store costs the batch no more than
    recompute would (up to that bound). Before a
    forward has been measured, recompute cannot be priced and the request is scheduled at once.
    While the existence query has not answered, the gain is the share of its pages queries have
    been finding (:attr:`.CostModel.found_share`): where storage rarely holds what is asked, no
    request waits to hear so.

    Parameters
    ----------
    view
        The fetch.
    costs
        The measured rates.
    page_size
        Tokens per page.
    block_s
        How long the scheduler may block for this fetch now.
    next_step_s
        Seconds until the scheduler looks again if it does not block.
    """
    if view.finished:
        return None
    per_page = costs.recompute_cost_s(page_size)
    if per_page is None:
        return None
    gain = (view.target_pages - view.read_pages) * per_page
    if not view.queried:
        gain *= costs.found_share
    eta = _fetch_eta_s(view, costs)
    cost = eta if eta <= block_s else max(eta, next_step_s)
    if gain <= 0 or cost >= gain or view.elapsed_s + cost >= view.target_pages * per_page:
        return None
    return eta
