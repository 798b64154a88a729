"""Greedy generations through the tier cache equal recompute, token for token, across tiers."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import FaultConfig, FaultRule, LayerConfig, StorageBackend, create_backend
from hicache_storage.engine.cache import CacheConfig, TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.errors import InvalidRequestError
from hicache_storage.engine.model import LlamaModel, ModelConfig
from hicache_storage.engine.policies import PrefetchPolicy, WritePolicy
from hicache_storage.engine.storage_io import Backup
from hicache_storage.errors import ConfigError
from hicache_storage.hostpool import MHAHostPool
from hicache_storage.kernels import DevicePool, KVTransfer
from hicache_storage.keys import namespace_seed
from hicache_storage.layers import ForwardingBackend

PAGE = 4
CONFIG = ModelConfig.tiny()


def build(
    device_tokens: int,
    host_tokens: int,
    backend: StorageBackend | None,
    layout: str = "layer_first",
    **config: Any,
) -> TierCache:
    c = CONFIG
    device = DevicePool.mha(device_tokens, c.layers, c.kv_heads, c.head_dim, c.dtype)
    host = (
        MHAHostPool(host_tokens, PAGE, c.layers, c.kv_heads, c.head_dim, c.dtype, layout, False)
        if host_tokens
        else None
    )
    config.setdefault("prefetch", PrefetchConfig(PrefetchPolicy.WAIT_COMPLETE))
    return TierCache(device, host, backend, CacheConfig(PAGE, **config))


def conversations(rounds: int, clients: int, seed: int = 0) -> list[list[int]]:
    """Multi-turn prompts: a shared system prompt, each round = history + a new turn."""
    rng = random.Random(seed)
    system = [rng.randrange(CONFIG.vocab_size) for _ in range(3 * PAGE + 1)]
    histories = [list(system) for _ in range(clients)]
    prompts = []
    for _ in range(rounds):
        for history in histories:
            history.extend(rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(3, 9)))
            prompts.append(list(history))
    return prompts


def run(engine: Engine, prompts: list[list[int]], new: int = 4) -> list[list[int]]:
    """Serve the prompts one after another, then close the engine (flushing its backups)."""
    outs = []
    with engine:
        for prompt in prompts:
            out = engine.generate(prompt, new)
            prompt.extend(out)  # the next round of this conversation includes the answer
            outs.append(out)
    return outs


@pytest.fixture
def memory_backend() -> Iterator[StorageBackend]:
    backend = create_backend("memory")
    yield backend
    backend.close()


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_every_tier_gives_the_tokens_of_recompute(
    model: LlamaModel, memory_backend: StorageBackend, policy: WritePolicy
) -> None:
    prompts = conversations(rounds=4, clients=3)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    # A device pool of a few requests' pages forces evictions to the host, a small host pool
    # pushes pages on to storage, and later rounds bring them back.
    cache = build(
        device_tokens=64, host_tokens=48, backend=memory_backend, write=WriteConfig(policy)
    )
    assert run(Engine(model, cache), [list(p) for p in prompts]) == expected
    cache.tree.check()
    stats = cache.stats
    assert stats.device_hit_tokens > 0 and stats.pages_backed_up > 0
    assert stats.host_hit_tokens + stats.storage_hit_tokens > 0
    assert cache.tree.locked_tokens == 0


class LateBackups:
    """A transfer whose device→host copies land only when waited for, as on a GPU.

    A GPU copy queued behind a forward writes the host slots later; here a backup snapshots its
    device rows and writes them to the host when a fence after it is waited for or a load runs.
    """

    def __init__(self, real: KVTransfer) -> None:
        self.real = real
        self.device = real.device
        self.host = real.host
        self.landed = 0
        self._lock = threading.Lock()
        self._pending: list[tuple[DevicePool, torch.Tensor]] = []

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor, **_: Any) -> None:
        rows = torch.as_tensor(device_indices)
        k, v = ([t[rows].clone() for t in part] for part in self.device.buffers)
        with self._lock:
            self._pending.append((DevicePool(k, v), torch.as_tensor(host_indices).clone()))

    def land(
        self, copies: Sequence[object] | None = None, slots: torch.Tensor | None = None
    ) -> None:
        """Land the pending copies among ``copies`` (all if None) or into ``slots``."""
        with self._lock:
            wanted = None if slots is None else set(slots.tolist())
            keep = []
            for copy in self._pending:
                rows, host = copy
                chosen = copies is None or any(copy is c for c in copies)
                if chosen and (wanted is None or wanted & set(host.tolist())):
                    KVTransfer(rows, self.host).backup(torch.arange(rows.size), host)
                    self.landed += 1
                else:
                    keep.append(copy)
            self._pending = keep

    def fence(self) -> LateFence:
        with self._lock:
            return LateFence(self, list(self._pending))

    def pending_slots(self) -> set[int]:
        with self._lock:
            return {int(i) for _, host in self._pending for i in host}

    def load(self, *args: Any, **kwargs: Any) -> None:
        self.land()  # a load queued after the copies runs after them
        self.real.load(*args, **kwargs)


class LateFence:
    """A fence after the copies :class:`LateBackups` had pending when it was made."""

    def __init__(self, transfer: LateBackups, copies: list[object]) -> None:
        self.transfer = transfer
        self.copies = copies

    def wait(self) -> None:
        self.transfer.land(self.copies)

    def done(self) -> bool:
        with self.transfer._lock:
            return not any(p is c for p in self.transfer._pending for c in self.copies)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fetch_never_reads_into_host_slots_a_late_copy_still_writes(
    model: LlamaModel, memory_backend: StorageBackend, seed: int
) -> None:
    """A host pool smaller than the device: evicting a stored page from the device copies it to
    the host, and the host may evict it again for a fetch before that copy has landed; the
    fetch's pages must not be overwritten when it does."""
    prompts = conversations(rounds=5, clients=4, seed=seed)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    cache = build(device_tokens=96, host_tokens=48, backend=memory_backend)
    assert cache.transfer is not None
    late = LateBackups(cache.transfer)
    cache.tiers.transfer = late  # type: ignore[assignment]
    assert cache.io is not None
    io_indices = cache.io._calls.indices
    fetched_into_late_copies = reads = 0

    def indices(host: torch.Tensor) -> torch.Tensor:  # the slots of a batch, as it is read
        nonlocal fetched_into_late_copies, reads
        reads += 1
        fetched_into_late_copies += len(late.pending_slots() & set(host.tolist()))
        return io_indices(host)

    def backup(job: Backup) -> bool:  # a write waits for the copies of its own pages only
        return io_backup(dataclasses.replace(job, ready=lambda: late.land(slots=job.host_indices)))

    io_backup = cache.io.backup
    cache.io._calls.indices = indices  # type: ignore[method-assign]
    cache.io.backup = backup  # type: ignore[method-assign]
    assert run(Engine(model, cache), [list(p) for p in prompts]) == expected
    assert fetched_into_late_copies == 0
    assert reads > 0 and late.landed > 0 and cache.stats.storage_hit_tokens > 0
    cache.tree.check()


def test_a_fetch_waits_only_for_the_copies_into_its_own_slots(
    memory_backend: StorageBackend,
) -> None:
    """The wait a fetch is given covers the copies in flight into its slots and no other."""
    cache = build(device_tokens=96, host_tokens=48, backend=memory_backend)
    assert cache.transfer is not None
    late = LateBackups(cache.transfer)
    cache.tiers.transfer = late  # type: ignore[assignment]
    first, second, other = (torch.arange(i * 16, i * 16 + 16) for i in range(3))
    cache.copies.copy_to_host(torch.arange(0, 16), first)
    cache.copies.copy_to_host(torch.arange(16, 32), second)
    assert cache.copies.copies_into(other) is None
    ready = cache.copies.copies_into(torch.cat([first[:1], other]))
    assert ready is not None and late.landed == 0, "made, not waited for"
    ready()
    assert late.landed == 1 and late.pending_slots() == set(second.tolist())
    cache.close()


def test_storage_alone_serves_a_fresh_engine(model: LlamaModel, tmp_path: Path) -> None:
    backend = create_backend("file", {"root": str(tmp_path)})
    prompts = conversations(rounds=2, clients=2, seed=3)
    first = build(256, 256, backend)
    expected = run(Engine(model, first), [list(p) for p in prompts])
    second = build(256, 256, create_backend("file", {"root": str(tmp_path)}))
    assert run(Engine(model, second), [list(p) for p in prompts]) == expected
    assert second.stats.storage_hit_tokens > 0 and second.stats.pages_fetched > 0
    backend.close()


def test_a_lost_storage_page_is_recomputed(
    model: LlamaModel, memory_backend: StorageBackend
) -> None:
    prompts = conversations(rounds=1, clients=1, seed=5)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    run(Engine(model, build(256, 256, memory_backend)), [list(p) for p in prompts])
    memory_backend.clear()  # every stored page is gone: the next engine must recompute
    cache = build(256, 256, memory_backend)
    assert run(Engine(model, cache), [list(p) for p in conversations(1, 1, seed=5)]) == expected
    assert cache.stats.storage_hit_tokens == 0


def test_namespaces_never_share_pages(model: LlamaModel) -> None:
    cache = build(256, 0, None)
    with Engine(model, cache) as engine:
        prompt = conversations(rounds=1, clients=1)[0]
        engine.generate(prompt, 2)
        engine.generate(prompt, 2, seed=namespace_seed(None, "tenant-b"))
        assert cache.stats.device_hit_tokens == 0
        engine.generate(prompt, 2)
        assert cache.stats.device_hit_tokens > 0


def test_a_device_pool_too_small_for_one_request_says_so(model: LlamaModel) -> None:
    with (
        Engine(model, build(8, 0, None)) as engine,
        pytest.raises(InvalidRequestError, match="needs 24 device slots; the pool has 8"),
    ):
        engine.generate(list(range(20)), 4)


@pytest.mark.parametrize(
    ("layout", "device_tokens", "host_tokens", "seed"),
    [("page_first", 64, 64, 1), ("page_first_direct", 72, 40, 2), ("page_head", 64, 56, 3)],
)
def test_host_layouts_and_pool_sizes(
    model: LlamaModel,
    memory_backend: StorageBackend,
    layout: str,
    device_tokens: int,
    host_tokens: int,
    seed: int,
) -> None:
    prompts = conversations(rounds=4, clients=3, seed=seed)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    cache = build(device_tokens, host_tokens, memory_backend, layout=layout)
    assert run(Engine(model, cache), [list(p) for p in prompts]) == expected
    cache.tree.check()
    assert cache.stats.pages_loaded > 0


def test_storage_faults_mid_run_degrade_to_recompute(model: LlamaModel) -> None:
    # Every storage call fails with probability 0.4 (the fault layer, seeded): failed writes
    # leave pages unstored, failed reads and existence checks are misses, never wrong tokens.
    faults = FaultConfig(seed=7, default=FaultRule(failure_rate=0.4))
    backend = create_backend("memory", layers=LayerConfig(faults=faults))
    prompts = conversations(rounds=4, clients=3, seed=11)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    cache = build(64, 48, backend)
    assert run(Engine(model, cache), [list(p) for p in prompts]) == expected
    cache.tree.check()
    assert sum(backend.stats()["faults"].values()) > 0, "the fault layer must have fired"
    backend.close()


class CountingSets(ForwardingBackend):
    """Record the pages of every ``batch_set_v1`` call."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.sets: list[int] = []

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        self.sets.append(len(keys))
        return self.inner.batch_set_v1(keys, host_indices)


def test_backups_write_as_many_pages_a_call_as_write_batch_bytes_holds(
    model: LlamaModel, memory_backend: StorageBackend
) -> None:
    prompt = [5 + (i * 13) % (CONFIG.vocab_size - 5) for i in range(100)]
    calls: dict[str, list[int]] = {}
    for name, pages in (("two pages", 2), ("default", None)):
        memory_backend.clear()
        counting = CountingSets(memory_backend)
        cache = build(256, 256, counting)
        page_bytes = cache.token_bytes * PAGE
        cache.close()
        options: dict[str, Any] = {"backlog": 1.0}  # the writer is never hurried
        if pages is not None:
            options["batch_bytes"] = pages * page_bytes + page_bytes // 2
        cache = build(256, 256, counting, write=WriteConfig(**options))
        run(Engine(model, cache), [list(prompt)])
        assert sum(counting.sets) == cache.stats.pages_stored > 2
        calls[name] = counting.sets
    assert max(calls["two pages"]) == 2, "at most two pages' bytes a call"
    assert len(calls["default"]) < len(calls["two pages"]), "small pages go many to a call"
    assert max(calls["default"]) > 2


def _host_full_of_unwritten_pages(
    model: LlamaModel, *, read_s_per_page: float | None
) -> tuple[TierCache, CountingSets]:
    """Serve conversations whose pages fill a small host while a slow writer stores them.

    ``read_s_per_page`` is what the store is known to take to read a page (None: unmeasured).
    Checks the tokens; returns the closed cache and the backend it wrote to.
    """
    prompts = conversations(rounds=3, clients=4, seed=21)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    slow = LayerConfig(faults=FaultConfig(ops={"batch_set_v1": FaultRule(delay_s=0.01)}))
    counting = CountingSets(create_backend("memory", layers=slow))
    cache = build(64, 48, counting)
    one_page = cache.token_bytes * PAGE
    cache.close()
    cache = build(64, 48, counting, write=WriteConfig(batch_bytes=one_page, backlog=1.0))
    if read_s_per_page is not None:
        cache.costs.observe_read(1, read_s_per_page)
    assert run(Engine(model, cache), [list(p) for p in prompts]) == expected
    cache.tree.check()
    return cache, counting


def test_a_host_full_of_unwritten_pages_hurries_the_writer_and_counts_the_wait(
    model: LlamaModel,
) -> None:
    """Room on the host comes from written pages: waiting for it, the writer stops trickling."""
    cache, counting = _host_full_of_unwritten_pages(model, read_s_per_page=None)
    assert cache.stats.host_room_wait_s > 0, "the host pool must have waited for writes"
    assert max(counting.sets) > 1, "a waited-for writer writes several pages a call"
    assert counting.sets.count(1) > 0, "until then it writes a page a call"
    counting.close()


def test_a_store_that_reads_slower_than_compute_is_not_waited_for_host_room(
    model: LlamaModel,
) -> None:
    """Writes pay only when their pages read back faster than they compute; else no wait.

    The same host full of unwritten pages, but the store is known to take 10 s to read a page:
    room the writes would free is refused at once (counted), and every request is still served
    with the same tokens.
    """
    cache, counting = _host_full_of_unwritten_pages(model, read_s_per_page=10.0)
    assert cache.stats.write_waits_skipped > 0, "room was refused instead of waited for"
    assert cache.stats.host_room_wait_s == 0
    assert cache.stats.pages_stored > 0, "what the writer took is still written"
    assert all(node.host_pins == 0 for node in cache.tree.nodes()), "every write unpinned"
    counting.close()


@pytest.mark.parametrize("backlog", [0.05, 1.0])
def test_a_backlog_past_its_share_of_the_host_hurries_the_writer_before_room_runs_out(
    model: LlamaModel, backlog: float
) -> None:
    """Pages waiting to be written past ``write.backlog`` of the host make the writer go wide.

    The host holds every page here, so no room is ever waited for: only the backlog's share
    can hurry the writer.
    """
    prompts = conversations(rounds=3, clients=4, seed=21)
    slow = LayerConfig(faults=FaultConfig(ops={"batch_set_v1": FaultRule(delay_s=0.02)}))
    counting = CountingSets(create_backend("memory", layers=slow))
    cache = build(512, 1024, counting)
    one_page = cache.token_bytes * PAGE
    cache.close()
    cache = build(512, 1024, counting, write=WriteConfig(batch_bytes=one_page, backlog=backlog))
    run(Engine(model, cache), [list(p) for p in prompts])
    assert cache.stats.host_room_wait_s == 0 and cache.stats.pages_dropped == 0
    assert sum(counting.sets) == cache.stats.pages_stored > 0
    if backlog < 1:
        assert max(counting.sets) > 1, "past its share, the backlog is written several a call"
    else:
        assert set(counting.sets) == {1}, "within its share, a page a call"
    counting.close()


def test_room_a_fetch_waits_for_is_counted_apart_from_room_for_copies(model: LlamaModel) -> None:
    """A fetch whose host slots wait for writes counts that wait as its own, within the total.

    A's pages are in storage; then B fills the host with pages a slow writer has not stored,
    and A's fetch needs their room: the wait is the fetch's (B's copies took free room).
    """
    rng = random.Random(5)
    a = [rng.randrange(CONFIG.vocab_size) for _ in range(6 * PAGE + 1)]
    # B's prompt pages fill 9 of the host's 10 (backed up as its prefill ends); its release
    # adds a tenth page (prompt and output) into free room, so only A's fetch waits.
    b = [rng.randrange(CONFIG.vocab_size) for _ in range(10 * PAGE - 3)]
    expected = run(Engine(model, None), [list(b), list(a)])
    slow = LayerConfig(faults=FaultConfig(ops={"batch_set_v1": FaultRule(delay_s=0.05)}))
    backend = create_backend("memory", layers=slow)
    run(Engine(model, build(64, 64, backend)), [list(a)])
    one_page = CONFIG.kv_bytes_per_token * PAGE
    cache = build(64, 10 * PAGE, backend, write=WriteConfig(batch_bytes=one_page))
    assert run(Engine(model, cache), [list(b), list(a)]) == expected
    assert cache.stats.pages_fetched > 0, "A came from storage"
    assert cache.stats.fetch_room_wait_s > 0, "A's fetch waited for B's pages to be written"
    assert cache.stats.fetch_room_wait_s <= cache.stats.host_room_wait_s
    backend.close()


def test_write_backlog_is_a_share_of_the_host_pool() -> None:
    for bad in (0, 1.5, -0.1, True, "0.5", float("nan")):
        with pytest.raises(ConfigError, match=r"write\.backlog must be a number in"):
            WriteConfig(backlog=bad)  # type: ignore[arg-type]


def test_background_writes_keep_the_tokens_and_leave_no_thread(
    model: LlamaModel, memory_backend: StorageBackend
) -> None:
    before = {t.ident for t in threading.enumerate()}
    prompts = conversations(rounds=4, clients=3, seed=13)
    expected = run(Engine(model, None), [list(p) for p in prompts])
    cache = build(64, 48, memory_backend, write=WriteConfig(queue=2))
    config = cache.config
    assert len(cache.threads) == config.threads.queries + config.threads.reads + 1
    assert all(t.is_alive() for t in cache.threads)
    engine = Engine(model, cache)
    assert engine.scheduler is not None
    backlogs: list[tuple[int, int]] = []  # (kept as writes come and go, counted afresh)

    def recount(_: object) -> None:
        pages = sum(len(hashes) for _, hashes, _ in cache.writes.writing.values())
        backlogs.append((cache.write_backlog_tokens, pages * PAGE))

    engine.scheduler.on_step = recount
    assert run(engine, [list(p) for p in prompts]) == expected
    assert any(kept for kept, _ in backlogs), "writes were in flight at some step"
    assert all(kept == counted for kept, counted in backlogs)
    assert cache.write_backlog_tokens == 0, "every write returned at close"
    assert not any(t.is_alive() for t in cache.threads)
    # The engine's threads, that is: the open backend's verify layer keeps its checksum threads
    # until the backend closes.
    engine_threads = {
        t.ident for t in threading.enumerate() if not t.name.startswith("hicache-verify")
    }
    assert engine_threads <= before
    assert cache.tree.locked_tokens == 0
    assert all(node.host_pins == 0 for node in cache.tree.nodes()), "every write unpinned"
    cache.tree.check()
    assert cache.stats.pages_stored > 0
    # A fresh engine is served from what the background writer stored.
    again = build(256, 256, memory_backend)
    assert run(Engine(model, again), [list(p) for p in prompts]) == expected
    assert again.stats.storage_hit_tokens > 0
