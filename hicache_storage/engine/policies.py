"""The cache controller's policies, each a value that can be swapped and tested alone.

- :class:`WritePolicy`: when pages computed on the device are copied to the host and storage.
- :class:`PrefetchPolicy` with :class:`PrefetchTimeout`: how long a waiting request lets its L3
  prefetch run before it is scheduled with whatever pages have arrived
  (:func:`prefetch_done_waiting`);
- :func:`adaptive_wait_s`: the ``adaptive`` policy's decision, fetch time against recompute time
  (:class:`FetchView` is what it knows of one fetch).

The names and meanings of the write policies and of three prefetch policies are SGLang's
(``--hicache-write-policy``, ``--hicache-storage-prefetch-policy``,
``prefetch_timeout_base``/``prefetch_timeout_per_ki_token``); ``adaptive`` is ours.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache_storage.config import check_duration

from .costs import CostModel

__all__ = [
    "FetchView",
    "PrefetchPolicy",
    "PrefetchTimeout",
    "WritePolicy",
    "adaptive_wait_s",
    "fetch_pays",
    "prefetch_done_waiting",
]


class WritePolicy(str, enum.Enum):
    """When pages computed on the device are copied to the host and to storage."""

    WRITE_THROUGH = "write_through"
    """Back up every new page at once (L1→L2→L3): the most hits, the most write traffic."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up a page once it has been hit ``backup_after_hits`` times: only reused pages."""
    WRITE_BACK = "write_back"
    """Back up only what eviction would otherwise lose: the least traffic, no L3 copy of what
    never leaves the device (another engine sharing the storage cannot hit it)."""


class PrefetchPolicy(str, enum.Enum):
    """When a request whose prefix is being fetched from storage stops waiting for it."""

    BEST_EFFORT = "best_effort"
    """Schedule at once with the pages already on the host; never delay a request."""
    WAIT_COMPLETE = "wait_complete"
    """Wait until every page found in storage has arrived (or failed): the most reuse."""
    TIMEOUT = "timeout"
    """Wait for the whole fetch up to a deadline grown with its size (:class:`PrefetchTimeout`)."""
    ADAPTIVE = "adaptive"
    """Fetch only what reads faster than it computes; wait only while waiting is cheaper than
    recomputing what has not arrived (:func:`adaptive_wait_s`). The default."""


@dataclass(frozen=True)
class PrefetchTimeout:
    """The ``timeout`` policy's deadline: ``base_s + per_page_s * pages`` after the fetch began.

    Attributes
    ----------
    base_s
        Seconds every fetch may take (the existence query, the first round trip).
    per_page_s
        Seconds more per page found in storage.
    """

    base_s: float = 0.5
    per_page_s: float = 0.005

    def __post_init__(self) -> None:
        for name in ("base_s", "per_page_s"):
            check_duration(f"prefetch timeout {name}", getattr(self, name), allow_zero=True)

    def deadline_s(self, pages: int) -> float:
        """Return how long a fetch of ``pages`` pages may run."""
        return self.base_s + self.per_page_s * pages


def prefetch_done_waiting(
    policy: PrefetchPolicy,
    timeout: PrefetchTimeout,
    *,
    finished: bool,
    pages: int,
    elapsed_s: float,
) -> bool:
    """Return whether a request should stop waiting for its prefetch and be scheduled.

    Parameters
    ----------
    policy, timeout
        The policy and, for ``timeout``, its deadline.
    finished
        The fetch has read every page it will read (or has failed).
    pages
        Pages the fetch is after: those found in storage once the existence query answered,
        else those asked for.
    elapsed_s
        Seconds since the fetch began.
    """
    if finished or policy is PrefetchPolicy.BEST_EFFORT:
        return True
    if policy is PrefetchPolicy.WAIT_COMPLETE:
        return False
    return elapsed_s >= timeout.deadline_s(pages)


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
    (:meth:`CostModel.recompute_cost_s`); reading them delays only the request that waits.

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
    of the batch waits for (:meth:`CostModel.recompute_cost_s`); waiting costs the time until
    they have arrived, or, when that is longer than the scheduler can block (``block_s``), the
    time to the next step (``next_step_s``) as well, and delays this request alone. The request
    waits only while waiting is the cheaper, and never longer in all than recomputing every page
    it is after would cost the batch, so a slow or unmeasured store costs the batch no more than
    recompute would (up to that bound). Before a
    forward has been measured, recompute cannot be priced and the request is scheduled at once.
    While the existence query has not answered, the gain is the share of its pages queries have
    been finding (:attr:`CostModel.found_share`): where storage rarely holds what is asked, no
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
