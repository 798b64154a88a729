"""The engine's planner: its back-pressure sheds the writes a store cannot absorb, never a stall.

Under ``adaptive`` the storage writer offers the pages of the backups it takes off its queue to
the cache's :class:`~hicache_storage.planner.Planner` right before it writes them; a backup the
planner sheds is released unwritten at once, as a failed one is, and counted by the rule that
shed it (``CacheStats.backup_pages_shed``). The scheduler waits for writes to free host room
only while the store is measured to keep up with its writer. So a store whose writes are slow
costs the scheduler no wait an L1+L2 cache would not make, a fast store has every page written,
and a store whose writes all fail is shed by the ``failing`` rule after
:data:`~hicache_storage.planner.rates.READ_SAMPLES` of them.

Every engine here prices recompute as a large model's would be (0.1 s a token): the tiny model
computes a page faster than Python reads one, and the planner would otherwise shed every write
by its ``unread`` rule (reading a page back costs more than computing it), not by the rates of
the writes these tests are about.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from rich.console import Console

from hicache_storage import StorageBackend, create_backend
from hicache_storage.cli.engine import _render_shortfall
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, ThreadConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.engine.scheduler import Request, StepRecord
from hicache_storage.engine.storage_io import Backup, BackupDone, StorageIO
from hicache_storage.layers import ForwardingBackend
from hicache_storage.planner import Planner, WritePlan
from hicache_storage.planner.rates import READ_SAMPLES

from ._child import PAGE, build_cache, conversations, host_pool, stored_prompt

PAGE_WRITE_S = 0.25
"""Seconds the slow store takes to write a page: the tiny model makes a page in milliseconds,
so the store falls behind by two orders of magnitude, however loaded the machine."""


class SlowWrites(ForwardingBackend):
    """Writes :data:`PAGE_WRITE_S` a page (a store whose bandwidth is short); counts the calls."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.calls = 0
        self._lock = threading.Lock()

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        with self._lock:
            self.calls += 1
        time.sleep(PAGE_WRITE_S * len(keys))
        return self.inner.batch_set_v1(keys, host_indices)


class FailedWrites(ForwardingBackend):
    """Stores nothing (every write fails) while its reads and queries serve; counts the writes."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.calls = 0

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.calls += 1
        return [False] * len(keys)


def adaptive(
    device_tokens: int, host_tokens: int, backend: StorageBackend | None, **config: Any
) -> TierCache:
    """An ``adaptive`` cache whose storage threads run at the process's priority.

    At the engine's defaults the writer runs only on cores nothing else wants: on a loaded
    machine a memory store's write then takes as long as the writer waits for a core, and the
    planner rightly sheds what that writer cannot absorb.
    """
    cache = build_cache(
        device_tokens,
        host_tokens,
        backend,
        prefetch=PrefetchConfig(PrefetchPolicy.ADAPTIVE),
        threads=ThreadConfig(nice=None, idle_writes=False),
        **config,
    )
    cache.costs.observe_forward(1000, 100.0)  # a large model's prefill: reading pays
    return cache


def serve(model: LlamaModel, cache: TierCache, prompts: list[list[int]]) -> list[Request]:
    """Serve ``prompts`` one after another, then close the engine (flushing its backups)."""
    with Engine(model, cache) as engine:
        return [engine.serve([Request(prompt, 4)])[0] for prompt in prompts]


def test_a_slow_store_is_shed_and_the_scheduler_waits_no_more_than_without_storage(
    model: LlamaModel,
) -> None:
    prompts = conversations(rounds=3, clients=4, seed=21)
    expected = [model.generate_no_cache(prompt, 4) for prompt in prompts]
    runs: dict[str, tuple[TierCache, list[StepRecord]]] = {}
    backend = SlowWrites(create_backend("memory"))
    for name, store in (("L1+L2", None), ("L1+L2+L3", backend)):
        cache = adaptive(64, 48, store)
        steps: list[StepRecord] = []
        with Engine(model, cache) as engine:
            assert engine.scheduler is not None
            engine.scheduler.on_step = steps.append
            got = [engine.serve([Request(prompt, 4)])[0].output for prompt in prompts]
        assert got == expected, name
        cache.tree.check()
        runs[name] = cache, steps
    host, host_steps = runs["L1+L2"]
    cache, steps = runs["L1+L2+L3"]
    stats = cache.stats
    assert host.stats.host_room_wait_s == 0 and not any(s.host_wait_s for s in host_steps)
    assert stats.host_room_wait_s == host.stats.host_room_wait_s, "waited for host room"
    assert not any(step.host_wait_s for step in steps), "a step waited for writes"
    assert stats.write_waits_skipped > 0, "the host filled with pages waiting to be written"
    # Whatever was shed (released unwritten) was shed by back-pressure alone: the writer's queue
    # beyond its room, or a store still being measured.
    assert set(stats.backup_pages_shed) <= {"backlog", "probe"}
    planned = cache.planner.stats()["write_pages"]
    assert isinstance(planned, dict)
    for rule, pages in stats.backup_pages_shed.items():
        assert planned[f"shed:{rule}"] == pages
    assert stats.pages_stored == planned["written"], "every admitted page was written"
    assert stats.backups_failed == 0
    assert backend.calls > 0 and not any(node.host_pins for node in cache.tree.nodes())
    backend.close()


def test_a_fast_store_has_every_page_written_and_read_back(model: LlamaModel) -> None:
    """A store that keeps up with its writer is never shed.

    The writer lingers half a second before each write and every request's pages are written
    before the next is served, so the writer is offered a page each 80 ms or slower, and a
    memory store writes one in under a millisecond: a loaded machine that stalls a few of its
    calls fiftyfold still leaves the store keeping up.
    """
    prompts = conversations(rounds=2, clients=4, seed=22)
    expected = [model.generate_no_cache(prompt, 4) for prompt in prompts]
    memory = create_backend("memory")
    first = adaptive(512, 512, memory, write=WriteConfig(linger_s=0.5))
    with Engine(model, first) as engine:
        for prompt, want in zip(prompts, expected, strict=True):
            assert engine.serve([Request(prompt, 4)])[0].output == want
            deadline = time.monotonic() + 30.0
            while first.write_backlog_tokens:
                assert time.monotonic() < deadline, "the writer never finished"
                time.sleep(0.01)
                first.poll()
    stats = first.stats
    assert stats.backup_pages_shed == {} and stats.backups_failed == 0
    assert stats.pages_stored > 0
    assert all(node.stored for node in first.tree.nodes() if not node.is_root)
    planned = first.planner.stats()["write_pages"]
    assert planned == {"written": stats.pages_stored}
    fresh = build_cache(512, 512, memory)  # waits for every page storage holds
    requests = serve(model, fresh, [list(p) for p in prompts])
    assert [r.output for r in requests] == expected
    for request, prompt in zip(requests, prompts, strict=True):
        usable = (len(prompt) - 1) // PAGE * PAGE
        assert request.device_hit + request.host_hit + request.storage_hit == usable
    assert requests[0].storage_hit == (len(prompts[0]) - 1) // PAGE * PAGE
    assert fresh.stats.pages_fetched > 0
    memory.close()


def test_a_store_whose_writes_fail_is_shed_by_the_failing_rule(model: LlamaModel) -> None:
    """Its reads serve, so it is not bypassed: the planner's own count of failed writes sheds."""
    memory, prompt, expected = stored_prompt(model, 200, 31)
    backend = FailedWrites(memory)
    cache = adaptive(512, 512, backend, write=WriteConfig(linger_s=0.0))
    offers: list[tuple[int, WritePlan]] = []
    offer = cache.planner.offer

    def record(keys: Sequence[str], **queue: Any) -> WritePlan:
        plan = offer(keys, **queue)
        offers.append((len(keys), plan))
        return plan

    cache.planner.offer = record  # type: ignore[method-assign]
    others = [[3 + (i * 7 + j * 11) % 500 for j in range(21)] for i in range(10)]
    outputs = serve(model, cache, [list(prompt), *others])
    first = outputs[0]
    assert first.output == expected
    assert first.storage_hit > 0, f"the reads did not serve: {first.storage_found=}, {cache.stats}"
    assert [r.output for r in outputs[1:]] == [model.generate_no_cache(p, 4) for p in others]
    assert not cache.costs.failing and cache.decisions.bypass() is None
    plans = [plan for _, plan in offers]
    assert len(plans) > READ_SAMPLES
    assert all(plan.pages and plan.rule == "probe" for plan in plans[:READ_SAMPLES])
    later = plans[READ_SAMPLES:]  # shed, but for one probe a READ_TTL_S after a failure
    assert all(plan.rule == "failing" for plan in later) and not all(p.pages for p in later)
    admitted = sum(keys for keys, plan in offers if plan.pages)
    shed = sum(keys for keys, plan in offers if not plan.pages)
    assert backend.calls == sum(1 for plan in plans if plan.pages), "a shed write is not made"
    stats = cache.stats
    assert stats.backup_pages_shed == {"failing": shed} and stats.backups_failed == admitted
    assert stats.pages_stored == 0
    assert not any(node.host_pins for node in cache.tree.nodes())
    memory.close()


def test_the_writer_reports_a_shed_backup_untried_with_the_rule() -> None:
    backend = FailedWrites(create_backend("memory"))
    pool = host_pool(64)
    backend.register_host_pool(pool)
    planner = Planner(PAGE)
    io = StorageIO(backend, planner=planner, pool=pool)
    outcomes: list[BackupDone] = []
    for i in range(READ_SAMPLES + 1):
        job = Backup([f"page-{i}-{j}" for j in range(2)], torch.arange(2 * PAGE), ticket=i)
        assert io.backup(job)
        deadline = time.monotonic() + 30.0
        while len(outcomes) <= i:
            assert time.monotonic() < deadline, "the writer never reported"
            outcomes.extend(io.poll(timeout_s=0.1))
    io.close()
    assert [done.shed_by for done in outcomes] == [None] * READ_SAMPLES + ["failing"]
    assert not any(done.stored for done in outcomes)
    assert backend.calls == READ_SAMPLES, "the shed backup reached the store"
    assert planner.stats()["write_pages"] == {"written": 2 * READ_SAMPLES, "shed:failing": 2}
    backend.close()


class HeldWrites(ForwardingBackend):
    """Holds its first write until :attr:`release` is set, so a queue builds up behind it."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.started = threading.Event()
        self.written: list[str] = []

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.started.set()
        assert self.release.wait(30.0), "never released"
        self.written.extend(keys)
        return self.inner.batch_set_v1(keys, host_indices)


def test_the_writer_sheds_the_oldest_backups_beyond_its_room_and_writes_the_rest() -> None:
    """Ten one-page backups queue behind a write in flight; the room holds three: the writer
    sheds the oldest until three wait behind the one it takes, then writes those four."""
    backend = HeldWrites(create_backend("memory"))
    pool = host_pool(64)
    backend.register_host_pool(pool)
    planner = Planner(PAGE)
    io = StorageIO(backend, planner=planner, write_batch_pages=1, write_room_pages=3, pool=pool)
    jobs = [Backup([f"page-{i}"], torch.arange(PAGE), ticket=i) for i in range(11)]
    assert io.backup(jobs[0])
    assert backend.started.wait(30.0)
    for job in jobs[1:]:
        assert io.backup(job)
    backend.release.set()
    outcomes: list[BackupDone] = []
    deadline = time.monotonic() + 30.0
    while len(outcomes) < len(jobs):
        assert time.monotonic() < deadline, "the writer never reported"
        outcomes.extend(io.poll(timeout_s=0.1))
    io.close()
    by_ticket = {done.backup.ticket: done for done in outcomes}
    assert [by_ticket[i].stored for i in range(11)] == [True] + [False] * 6 + [True] * 4
    assert [by_ticket[i].shed_by for i in range(1, 7)] == ["backlog"] * 6
    assert backend.written == ["page-0", "page-7", "page-8", "page-9", "page-10"]
    assert planner.stats()["write_pages"] == {"written": 5, "shed:backlog": 6}
    backend.close()


def test_the_bench_says_which_rule_shed_the_pages_storage_did_not_get() -> None:
    shed = {"failing": 4, "absorb": 1200}
    runs = [
        SimpleNamespace(name="host-only", cache={}),
        SimpleNamespace(name="stored", cache={"prefetches": 3, "backup_pages_shed": shed}),
        SimpleNamespace(name="unshed", cache={"prefetches": 3, "backup_pages_shed": {}}),
    ]
    console = Console(record=True, width=240)
    _render_shortfall(runs, console)  # type: ignore[arg-type]
    text = console.export_text()
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("│")}
    assert "pages shed" in text and set(rows) == {"stored", "unshed"}
    assert rows["stored"].split("│")[-2].strip() == "absorb 1,200, failing 4"
    assert rows["unshed"].split("│")[-2].strip() == "0"
