"""vLLM's back-pressure detector for the tier, its pressure the planner's measured rates.

vLLM's tiering manager asks a tier's detector ``should_store(num_blocks)`` before it pins the
chunks of a store job, feeds it ``update`` after each store job that succeeded, exports its
``stats["store_latency_ema"]`` (seconds per MiB written) and its policy's dropped stores and
blocks as Prometheus metrics, and resets it with the cache. Its own
``EMABackpressureDetector`` sheds stores above fixed water marks (seconds per MiB measured on one
NVMe and one CephFS cluster). The tier's planner sheds from measured rates instead
(:meth:`~hicache_storage.planner.Planner.offer`: what the store absorbs against what vLLM
offers), and it needs the chunks' keys to decide (its admission counts keys), which
``should_store`` is not given. So :class:`PlannerPressure` admits every job there, the tier
offers each step's store jobs to the planner in one call, and the detector reports what the
planner did: its pressure (the planner shed its latest offer for a rate), the planner's measured
write rate as vLLM's gauge, and every shed job in vLLM's dropped-stores counters. vLLM's metrics
and logs then tell of the tier's shedding as of its own detectors'.

The tier installs it where its entry names no ``backpressure``; one that does keeps vLLM's
detector, which sheds first, and the planner sheds what the store still cannot absorb.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector, DropStorePolicy

__all__ = ["PlannerPressure"]

_MIB = 1 << 20


class PlannerPressure(BackpressureDetector):  # type: ignore[misc]  # vLLM ships no type information
    """A detector whose pressure and rates are the tier planner's (see the module docstring).

    Parameters
    ----------
    write_s_per_page
        The planner's measured seconds a chunk takes to write, or None unmeasured.
    chunk_bytes
        Bytes of a chunk, to state the write rate in vLLM's seconds per MiB.
    """

    def __init__(self, write_s_per_page: Callable[[], float | None], chunk_bytes: int) -> None:
        # Only the policy's drop accounting is used: the planner has already decided.
        super().__init__(policy=DropStorePolicy())
        self._write_s_per_page = write_s_per_page
        self._chunk_mib = chunk_bytes / _MIB
        self._shed_by: str | None = None

    def should_store(self, num_blocks: int) -> bool:
        """Admit the job: the tier offers its keys to the planner with the step's other jobs."""
        return True

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        """Nothing to learn: the planner times the writes itself, not their queueing."""

    def is_under_pressure(self) -> bool:
        """Whether the planner shed its latest offer for a rate (not for admission)."""
        return self._shed_by is not None

    def offered(self, rule: str | None, jobs_shed: list[int]) -> None:
        """Record an offer: the rule that shed it (None if admitted) and each shed job's chunks."""
        self._shed_by = rule
        for blocks in jobs_shed:
            self.policy.on_store_skipped(blocks)

    def reset(self) -> None:
        """Forget the dropped counts (vLLM resets them with the cache; the rates stay)."""
        self._shed_by = None
        self.policy.reset()

    @property
    def stats(self) -> dict[str, float]:
        """The planner's measured write rate in vLLM's unit, seconds per MiB, once measured."""
        per_page = self._write_s_per_page()
        if per_page is None or self._chunk_mib <= 0:
            return {}
        return {"store_latency_ema": per_page / self._chunk_mib}
