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
includes the ``alloc_device`` and ``_backup`` calls it makes.
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

METHODS = (
    "lookup",
    "ready",
    "acquire",
    "release",
    "poll",
    "start_reads",
    "alloc_device",
    "_alloc_host",
    "_backup",
    "_write_through",
    "_mark_in_storage",
    "_assign_slots",
    "_start_prefetch",
    "_copies_into",
    "_stage",
    "_retry_stages",
    "_unpin_loaded",
    "take_load",
)

seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
cpu_seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
calls: collections.Counter[tuple[str, str]] = collections.Counter()
labels: set[str] = set()


def label(cache: TierCache) -> str:
    """Name a cache's configuration the way the bench does."""
    if not cache.config.prefix_cache:
        return "no-cache"
    if cache.host_pool is None:
        return "L1"
    return "L1+L2" if cache.io is None else "L1+L2+L3"


def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``method`` to add its time on the main thread to its configuration's total."""
    main = threading.main_thread()

    def call(self: TierCache, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not main:
            return method(self, *args, **kwargs)
        began, cpu_began = time.perf_counter(), time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            labels.add(config := label(self))  # by configuration, not id(): ids are reused
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
    for name in METHODS:
        cells = [
            f"{seconds[(c, name)] * 1e3 / repeat:9.2f} {cpu_seconds[(c, name)] * 1e3 / repeat:9.2f}"
            f" {calls[(c, name)] // repeat:7d} x"
            for c in configs
        ]
        print(f"{name:18s}" + "".join(f"{cell:>32s}" for cell in cells))


def main() -> None:
    """Run the bench with the wrapped methods, then print the table."""
    for name in METHODS:
        setattr(TierCache, name, timed(name, getattr(TierCache, name)))
    args = sys.argv[1:]
    repeat = int(args[args.index("--repeat") + 1]) if "--repeat" in args else 1
    try:
        cli(["engine", "bench", *args], standalone_mode=False)
    finally:
        report(repeat)


if __name__ == "__main__":
    main()
