"""The benchmarks, one per thing this project makes fast, with one report convention.

- :mod:`~hicache_storage.bench.backend` (``hicache bench BACKEND``): a backend's calls beside
  its raw client (:class:`~hicache_storage.kit.Baseline`), copy or zero-copy (``--v1``);
- :mod:`~hicache_storage.bench.engine` (``hicache engine bench``): the tier engine's TTFT and
  throughput with no cache, L1+L2 and L1+L2+L3, beside each request's bound;
- :mod:`~hicache_storage.bench.kernels` (``hicache kernels bench``): the transfer kernels
  beside contiguous pinned copies, per-page copy loops and gathers.

The convention all three keep: every figure is printed beside the best alternative measured in
the same run, as a ratio (never against a number from elsewhere); a table goes to the terminal
and every number, with the command and the machine, to JSON (``--json``); sizes print through
:mod:`~hicache_storage.bench.report`, so "4 MiB" means the same everywhere.
"""
