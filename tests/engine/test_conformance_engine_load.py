"""The engine check's verdict does not depend on how busy the machine is.

Ten runs in a row of the cases that once depended on it, over the bounded file store of
issue 48 (20,000 bytes: a few pages), while two processes keep both cores of a small machine
busy: every run passes, and ``fresh_engine`` makes a real round trip through the store (it is
not skipped).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_storage.conformance.engine import check_engine
from hicache_storage.conformance.factory import BackendFactory

RUNS = 10
CASES = ["write_through/wait_complete", "write_through/timeout", "fresh_engine"]
"""The ``timeout`` policy and the waiting one's warm engine, and the fresh engine's round trip."""


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Processes that spin for the whole test: two, less the other pytest-xdist workers.

    The load meant is both cores of a two-core machine busy beside the test; another worker
    of the same run is already one busy process, and more would oversubscribe the cores.
    """
    others = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1
    count = max(2 - others, 0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("one_torch_thread", "busy_cores")
def test_the_engine_check_of_a_bounded_store_passes_every_run_under_load(tmp_path: Path) -> None:
    for run in range(RUNS):
        root = tmp_path / f"run-{run}"
        root.mkdir()
        factory = BackendFactory("file", {"root": str(root), "max_bytes": 20000})
        report = check_engine(factory, cases=CASES)
        failures = [f"{c.name} {c.outcome}: {c.message}" for c in report.failures()]
        assert not failures, f"run {run + 1} of {RUNS}: " + "; ".join(failures)
        fresh = report.check("fresh_engine")
        assert fresh.outcome == "passed", f"run {run + 1}: {fresh.message}"
        assert fresh.stats["fresh_storage_hit_tokens"] > 0
