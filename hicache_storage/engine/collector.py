"""The garbage collector while serving: collections between steps, over what serving made.

CPython's collector runs in whichever thread allocates past its threshold, holding the GIL
until it is done, so every other thread waits for it. Two things make that costly in an engine,
both measured on the 2-core VM with the engine bench's documents workload:

- a *full* pass walks every container object of the process: after importing torch and building
  a model that is some 300,000, and one pass took 140-150 ms in the middle of a run;
- a pass that starts in a background storage thread runs at that thread's priority: a writer
  under ``SCHED_IDLE`` that holds the GIL for a young-generation pass of a millisecond was kept
  off the cores by the forward's threads for 84-757 ms while everyone waited for the GIL.

:class:`ManagedCollection` therefore collects once and freezes what is alive (``gc.freeze``:
later passes skip it; serving engines do the same at startup), turns automatic collection off
and leaves the collections to :meth:`ManagedCollection.collect_due`, which the scheduler calls
between steps on its own thread: the same generations, on the same thresholds, never inside a
forward or a storage call. :class:`CollectorPauses` measures every collection, any thread's,
through ``gc.callbacks``.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from typing import Any

__all__ = ["CollectorPauses", "ManagedCollection"]


class ManagedCollection:
    """Process-wide: frozen heap and collections at chosen points while any holder serves.

    The first :meth:`hold` collects, freezes and disables automatic collection; the last
    :meth:`release` restores what it found (a heap someone else froze stays frozen, a collector
    someone else disabled stays off). Holds nest across engines in one process.
    """

    _lock = threading.Lock()
    _holders = 0
    _thaw = False
    _enable = False

    @classmethod
    def hold(cls) -> None:
        """Take a hold: collect and freeze what is alive now; automatic collection off."""
        with cls._lock:
            if cls._holders == 0:
                cls._thaw = gc.get_freeze_count() == 0
                cls._enable = gc.isenabled()
            gc.disable()
            gc.collect()
            gc.freeze()
            cls._holders += 1

    @classmethod
    def release(cls) -> None:
        """Give back a hold; the last one unfreezes and re-enables as they were."""
        with cls._lock:
            if cls._holders == 0:
                return
            cls._holders -= 1
            if cls._holders:
                return
            if cls._thaw:
                gc.unfreeze()
            if cls._enable:
                gc.enable()

    @classmethod
    def holding(cls) -> bool:
        """Whether any hold is taken."""
        return cls._holders > 0

    @staticmethod
    def collect_due() -> int | None:
        """Run the collection that automatic collection would have run by now, if any.

        As CPython decides: once the youngest generation's count passes its threshold, the
        oldest generation whose count passes its own is collected (an older generation counts
        the collections of the one below it since it was last collected; ``gc.get_count``,
        ``gc.get_threshold``). Returns the generation collected, or None.
        """
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if thresholds[0] == 0 or counts[0] <= thresholds[0]:
            return None
        generation = next(g for g in (2, 1, 0) if g == 0 or counts[g] > thresholds[g])
        gc.collect(generation)
        return generation


class CollectorPauses:
    """Seconds the garbage collector has run, in any thread, since :meth:`take` last asked.

    Registered in ``gc.callbacks`` from construction until :meth:`close` (by a weak reference:
    an instance nobody closes is still freed). Collections do not overlap (each holds the GIL),
    so one clock serves every thread.
    """

    def __init__(self) -> None:
        self._began = 0.0
        self._total_s = 0.0
        self._taken_s = 0.0
        self.longest_s = 0.0
        """The longest single collection seen so far."""
        self.full_passes = 0
        """Collections of the oldest generation seen so far."""
        ref = weakref.ref(self)

        def observe(phase: str, info: dict[str, Any]) -> None:
            pauses = ref()
            if pauses is not None:
                pauses._observe(phase, info)

        self._callback = observe
        gc.callbacks.append(observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = time.perf_counter() - self._began
        self._total_s += seconds
        self.longest_s = max(self.longest_s, seconds)
        if info.get("generation") == 2:
            self.full_passes += 1

    def take(self) -> float:
        """Return the seconds collected since the last call (or construction).

        Nothing here allocates a tracked object, so no collection can start halfway and be lost.
        """
        total = self._total_s
        seconds = total - self._taken_s
        self._taken_s = total
        return seconds

    def close(self) -> None:
        """Stop measuring; idempotent."""
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)
