"""The never-worse matrix: the storage tier against the better of no cache and the host alone.

A storage tier is judged by every configuration a user may run, not by the workload it was tuned
on: model shapes (compute per KV byte), host-to-device ratios (how much the host already holds),
write and prefetch policies. Each cell of :func:`run_matrix` serves one documents workload
(documents longer than the device pool holds, each queried in turn) three ways, no cache, the
device and host pools (``L1+L2``) and the three tiers (``L1+L2+L3``), in one process on one
machine, and reports ``L1+L2+L3``'s mean and p99 time to first token over the better of the
other two (``CellResult.baseline``). A failing-store row serves the same workload with every
storage call failing after the store's deadline, against ``L1+L2``: the host-only run a failing
store must not make slower.

Nothing is asserted here: :attr:`CellResult.worse` compares a ratio with the goal it is printed
beside (:data:`GOAL`, :data:`FAILING_GOAL`), so a reader sees which cells miss and by how much.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.queues
import pickle
import queue
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath

import msgspec
import torch

from hicache_storage.config import FaultConfig, FaultRule
from hicache_storage.errors import ConfigError

from .engine import BenchConfig, BenchJob, BenchResult, RunResult, run_benches

__all__ = [
    "FAILING_GOAL",
    "GOAL",
    "Cell",
    "CellResult",
    "MatrixResult",
    "cell_details",
    "cells",
    "run_matrix",
]

GOAL = 1.05
"""Most a cell's ``L1+L2+L3`` TTFT (mean and p99) may be over the better of no cache and L1+L2:
the issue's bound, the spread of repeated runs of one configuration on one machine."""

FAILING_GOAL = 1.1
"""Most the failing-store run's TTFT may be over the host-only run's."""

FAILING_STORE = FaultConfig(default=FaultRule(failure_rate=1.0, delay_s=0.05))
"""Every storage call fails, after 50 ms: a store that times out rather than refusing at once
(an instant refusal is the easy case). 50 ms is the deadline order of a remote store's call."""


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix.

    Attributes
    ----------
    model
        A bench model name or a ``config.json`` path (:attr:`BenchConfig.model`).
    host_ratio
        Host pool over device pool, in tokens (SGLang's ``--hicache-ratio``).
    write_policy, prefetch_policy
        The cache's policies, by their SGLang names.
    failing
        Serve with every storage call failing (compared with ``L1+L2`` only).
    """

    model: str
    host_ratio: float
    write_policy: str
    prefetch_policy: str
    failing: bool = False

    @property
    def label(self) -> str:
        """A short name for tables and progress lines."""
        name = self.model
        if name.endswith(".json"):  # a directory's config.json is named by the directory
            path = PurePath(name)
            name = path.parent.name if path.name == "config.json" else path.stem
        tail = " failing store" if self.failing else ""
        return f"{name} host {self.host_ratio:g}x {self.write_policy}/{self.prefetch_policy}{tail}"


def cells(
    models: Sequence[str],
    ratios: Sequence[float],
    write_policies: Sequence[str],
    prefetch_policies: Sequence[str],
    *,
    failing: bool = True,
) -> list[Cell]:
    """Return every combination, and a failing-store cell per model at the first ratio."""
    grid = [
        Cell(model, ratio, write, prefetch)
        for model in models
        for ratio in ratios
        for write in write_policies
        for prefetch in prefetch_policies
    ]
    if failing:
        grid += [
            Cell(model, ratios[0], write_policies[0], prefetch_policies[0], failing=True)
            for model in models
        ]
    return grid


def cell_config(base: BenchConfig, cell: Cell) -> BenchConfig:
    """Return ``base`` with ``cell``'s model, policies, host pool and faults."""
    page = base.cache.page_size
    host = int(base.engine.device_tokens * cell.host_ratio) // page * page
    if host < page:
        raise ConfigError(f"host ratio {cell.host_ratio} leaves no host page")
    return base.with_settings(
        {
            "model": cell.model,
            "engine.host_tokens": host,
            "write.policy": cell.write_policy,
            "prefetch.policy": cell.prefetch_policy,
            "faults": FAILING_STORE if cell.failing else base.faults,
        }
    )


@dataclass
class CellResult:
    """One cell's figures: each configuration's mean and p99 TTFT (seconds), and the ratios."""

    cell: Cell
    ttft_mean_s: dict[str, float]
    ttft_p99_s: dict[str, float]
    storage_hit_tokens: int
    identical: bool
    baseline: str
    mean_ratio: float
    p99_ratio: float
    result: BenchResult | None = field(default=None, repr=False)

    @property
    def goal(self) -> float:
        """The bound this cell's ratios are held to."""
        return FAILING_GOAL if self.cell.failing else GOAL

    @property
    def worse(self) -> bool:
        """Whether the storage tier made this cell slower than its goal allows."""
        return max(self.mean_ratio, self.p99_ratio) > self.goal


@dataclass
class MatrixResult:
    """Every cell's result, in the order run."""

    cells: list[CellResult]

    def to_json(self) -> bytes:
        """Return the figures (not the per-request records) as JSON."""
        slim = [dataclasses.replace(cell, result=None) for cell in self.cells]
        return msgspec.json.format(msgspec.json.encode(slim), indent=1)


def cell_details(cell: CellResult) -> bytes:
    """Return one cell's ratios and runs as JSON, without per-request and per-step records.

    What a reader needs to see where a cell's time went: parts, waits, planner, storage calls.
    """
    runs = [] if cell.result is None else cell.result.runs
    slim = [dataclasses.replace(run, records=[], steps=[]) for run in runs]
    return msgspec.json.encode({"cell": dataclasses.replace(cell, result=None), "runs": slim})


def summarise(cell: Cell, result: BenchResult) -> CellResult:
    """Return ``cell``'s ratios from its bench result."""
    runs: dict[str, RunResult] = {run.name: run for run in result.runs if run.repeat == 0}
    mean = {name: run.ttft_mean_s for name, run in runs.items()}
    p99 = {name: run.ttft_p99_s for name, run in runs.items()}
    candidates = ["L1+L2"] if cell.failing else ["no-cache", "L1+L2"]
    baseline = min(candidates, key=lambda name: mean[name])
    tier = runs["L1+L2+L3"]
    return CellResult(
        cell=cell,
        ttft_mean_s=mean,
        ttft_p99_s=p99,
        storage_hit_tokens=tier.storage_hit_tokens,
        identical=all(run.identical for run in runs.values()),
        baseline=baseline,
        mean_ratio=mean["L1+L2+L3"] / mean[baseline],
        p99_ratio=p99["L1+L2+L3"] / min(p99[name] for name in candidates),
        result=result,
    )


def run_matrix(
    base: BenchConfig,
    grid: Iterable[Cell],
    *,
    done: Callable[[CellResult], None] | None = None,
    isolate: bool | None = None,
) -> MatrixResult:
    """Serve every cell of ``grid`` over ``base``'s workload; ``done`` sees each as it ends.

    The cells of one model share one model build and one ``no-cache`` run, and the cells of
    one host pool and write policy one ``L1+L2`` run (neither depends on what the store or the
    prefetch policy does), so a model's row costs one run per cell and a few more. With
    ``isolate`` (the default on a GPU) each model's cells run in a child process of their
    own: they start on a GPU no other model's weights, pools, graphs or allocator still hold
    (in one process the fifth model no longer fit).
    """
    if isolate is None:
        isolate = torch.device(base.device).type == "cuda"
    results: list[CellResult] = []
    for group in _by_model(grid):
        jobs = _jobs(base, group)
        served = _run_isolated(jobs) if isolate else _run_here(jobs)
        borrowed: dict[tuple[float, str], RunResult] = {}
        for index, bench in served:
            cell = group[index]
            key = (cell.host_ratio, cell.write_policy)
            own = [run for run in bench.runs if run.name == "L1+L2"]
            if own:
                borrowed[key] = own[0]
            elif key in borrowed:
                bench = dataclasses.replace(bench, runs=[*bench.runs, borrowed[key]])
            summary = summarise(cell, bench)
            results.append(summary)
            if done is not None:
                done(summary)
    return MatrixResult(results)


def _by_model(grid: Iterable[Cell]) -> list[list[Cell]]:
    """Return ``grid``'s cells grouped by model, models and cells in the order given."""
    groups: dict[str, list[Cell]] = {}
    for cell in grid:
        groups.setdefault(cell.model, []).append(cell)
    return list(groups.values())


def _jobs(base: BenchConfig, group: Sequence[Cell]) -> list[BenchJob]:
    """Return each cell's configuration and runs: ``L1+L2`` once per host pool and write policy."""
    seen: set[tuple[float, str]] = set()
    jobs: list[BenchJob] = []
    for cell in group:
        key = (cell.host_ratio, cell.write_policy)
        names = ["L1+L2+L3"] if key in seen else ["L1+L2", "L1+L2+L3"]
        seen.add(key)
        jobs.append((cell_config(base, cell), names))
    return jobs


def _run_here(jobs: Sequence[BenchJob]) -> Iterator[tuple[int, BenchResult]]:
    """Serve ``jobs`` in this process, yielding each job's result as it ends."""
    yield from enumerate(run_benches(jobs))


def _run_isolated(jobs: Sequence[BenchJob]) -> Iterator[tuple[int, BenchResult]]:
    """Serve ``jobs`` in a fresh child process, yielding each job's result as it ends.

    A child that dies without a word (killed, out of memory) ends the matrix with an error
    rather than leaving the parent waiting.
    """
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    channel = context.Queue()
    child = context.Process(target=_child, args=(list(jobs), channel), daemon=True)
    child.start()
    try:
        while True:
            try:
                kind, index, payload = channel.get(timeout=_POLL_S)
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(
                        f"the matrix's child process ended (exit code {child.exitcode})"
                    ) from None
                continue
            if kind == "done":
                return
            if kind == "error":
                if isinstance(payload, BaseException):
                    raise payload
                raise RuntimeError(f"the matrix's child process failed:\n{payload}")
            assert isinstance(payload, BenchResult)
            yield index, payload
    finally:
        child.join(timeout=_POLL_S)
        if child.is_alive():
            child.kill()


_POLL_S = 5.0
"""How often the parent checks that a silent child is still alive."""

_Message = tuple[str, int, object]
"""What the child sends: ``result`` (a job's index, its result), ``error`` or ``done``."""


def _child(jobs: list[BenchJob], channel: multiprocessing.queues.Queue[_Message]) -> None:
    """Serve ``jobs`` and send each result, then ``done`` or the error.

    The error goes as itself where it pickles (a ``ConfigError`` reaches the command as one),
    else as its traceback.
    """
    try:
        run_benches(jobs, done=lambda index, bench: channel.put(("result", index, bench)))
    except Exception as error:  # noqa: BLE001 - raised again in the parent
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - sent as its traceback instead
            channel.put(("error", -1, traceback.format_exc()))
        else:
            channel.put(("error", -1, error))
        return
    channel.put(("done", -1, None))
