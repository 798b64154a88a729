"""The cache controller's policies, each a value that can be swapped and tested alone.

- :class:`WritePolicy`: when pages computed on the device are copied to the host and storage.
- :class:`PrefetchPolicy` with :class:`PrefetchTimeout`: how long a waiting request lets its L3
  prefetch run before it is scheduled with whatever pages have arrived
  (:func:`prefetch_done_waiting`);
- ``adaptive``, whose decision, fetch time against recompute time, is the planner's
  (:func:`hicache_storage.planner.fetch.adaptive_wait_s`).

The cache decides through one object per prefetch policy
(:func:`~hicache_storage.engine.fetch_decisions.decisions_for`): SGLang's three policies share
:class:`~hicache_storage.engine.fetch_decisions.FetchDecisions`, ``adaptive`` has
:class:`~hicache_storage.engine.fetch_decisions.AdaptiveDecisions`.

The names and meanings of the write policies and of three prefetch policies are SGLang's
(``--hicache-write-policy``, ``--hicache-storage-prefetch-policy``,
``prefetch_timeout_base``/``prefetch_timeout_per_ki_token``); ``adaptive`` is ours.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache_storage.config import check_duration

__all__ = [
    "PrefetchPolicy",
    "PrefetchTimeout",
    "WritePolicy",
    "prefetch_done_waiting",
]


class WritePolicy(str, enum.Enum):
    """When pages computed on the device are copied to the host and to storage."""

    WRITE_THROUGH = "write_through"
    """Back up every new page at once (L1→L2→L3): the most hits, the most write traffic."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up a page once it has been hit ``write.backup_after_hits`` times: only reused pages."""
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
    recomputing what has not arrived (:func:`~hicache_storage.planner.fetch.adaptive_wait_s`).
    The default."""


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
