"""Where the scheduler's thread spends its time in each configuration of ``hicache engine bench``.

The bench's breakdown says how long a request waited; this says what the scheduler's thread did
meanwhile. It runs the bench with the given options while timing the tier cache's entry points
(and the inner steps that move pages between tiers) on that thread, then prints, per method,
the milliseconds (wall clock and the thread's own CPU clock) and calls per run of each
configuration. A method that takes longer beside a storage tier for the same calls is where the
tier taxes compute: extra work (CPU time grows too), or a wait for the GIL taken by a storage
thread while the scheduler's thread was in it (wall time grows alone).

    python scripts/probe_scheduler_time.py --runs L1+L2,L1+L2+L3 --backend file --repeat 3 ...

Every option is handed to ``hicache engine bench`` (``--json`` too). Times nest: ``acquire``
includes the ``alloc_device`` and ``backup`` calls it makes.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hicache_storage.cli import main as cli
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.copies import CopiesInFlight
from hicache_storage.engine.prefetches import Prefetches
from hicache_storage.engine.tiers import Tiers
from hicache_storage.engine.transfers import Transfers
from hicache_storage.engine.writes import StorageWrites

METHODS: tuple[tuple[type, str], ...] = (
    (TierCache, "lookup"),
    (TierCache, "ready"),
    (TierCache, "acquire"),
    (TierCache, "release"),
    (TierCache, "poll"),
    (TierCache, "start_reads"),
    (Transfers, "alloc_device"),
    (StorageWrites, "alloc_host"),
    (Transfers, "backup"),
    (TierCache, "_write_through"),
    (TierCache, "_mark_in_storage"),
    (Prefetches, "assign_slots"),
    (Prefetches, "start"),
    (CopiesInFlight, "copies_into"),
    (StorageWrites, "stage"),
    (StorageWrites, "retry_stages"),
    (CopiesInFlight, "unpin_loaded"),
    (TierCache, "take_load"),
)
"""The methods timed: the cache's entry points, then the parts' steps that move pages."""

seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
cpu_seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
calls: collections.Counter[tuple[str, str]] = collections.Counter()
labels: set[str] = set()


def label(tiers: Tiers) -> str:
    """Name a cache's configuration the way the bench does."""
    if not tiers.config.prefix_cache:
        return "no-cache"
    if tiers.host_pool is None:
        return "L1"
    return "L1+L2" if tiers.io is None else "L1+L2+L3"


def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``method`` to add its time on the main thread to its configuration's total."""
    main = threading.main_thread()

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not main:
            return method(self, *args, **kwargs)
        began, cpu_began = time.perf_counter(), time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            labels.add(config := label(self.tiers))  # by configuration, not id(): ids are reused
            key = (config, name)
            seconds[key] += time.perf_counter() - began
            cpu_seconds[key] += time.thread_time() - cpu_began
            calls[key] += 1

    return call


def report(repeat: int) -> None:
    """Print ms (wall and on the CPU) and calls per run of each method, a column a configuration.

    Wall time the thread did not spend on the CPU is waiting: for the GIL, a lock, or a
    blocking call (a CUDA synchronisation spins on the CPU by default, so it counts as CPU).
    """
    configs = [c for c in ("no-cache", "L1", "L1+L2", "L1+L2+L3") if c in labels]
    print(f"{'method':18s}" + "".join(f"{c + ' (wall/cpu ms, calls)':>32s}" for c in configs))
    for _, name in METHODS:
        cells = [
            f"{seconds[(c, name)] * 1e3 / repeat:9.2f} {cpu_seconds[(c, name)] * 1e3 / repeat:9.2f}"
            f" {calls[(c, name)] // repeat:7d} x"
            for c in configs
        ]
        print(f"{name:18s}" + "".join(f"{cell:>32s}" for cell in cells))


def main() -> None:
    """Run the bench with the wrapped methods, then print the table."""
    for owner, name in METHODS:
        setattr(owner, name, timed(name, getattr(owner, name)))
    args = sys.argv[1:]
    repeat = int(args[args.index("--repeat") + 1]) if "--repeat" in args else 1
    try:
        cli(["engine", "bench", *args], standalone_mode=False)
    finally:
        report(repeat)


if __name__ == "__main__":
    main()
