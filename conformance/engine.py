"""Engine-level conformance: a backend holds a model's KV cache and no generated token changes.

The storage suite checks a backend one call at a time; :func:`check_engine` checks what serving
does with those calls. A tiny seeded Llama-style model answers multi-turn conversations (a shared
system prompt; each round, every client's history plus a new turn) through an
:class:`~hicache_storage.engine.engine.Engine` whose device and host pools are too small for the
histories: pages are evicted to the host and on to the backend, and later rounds and fresh engines
bring them back. Every greedy answer must equal, token for token, the answer of a run that
recomputes everything (the oracle, computed once per model and workload). Different tokens are
never acceptable; a failure names the request and the first differing position.

The cases, each a row of the :class:`EngineReport`:

``<write>/<prefetch>``
    One run per pair of :data:`POLICIES`: each write policy with ``wait_complete``, and
    ``write_through`` with the other prefetch policies; a warm engine, then a fresh one over the
    same storage.
``fresh_engine``
    A fresh engine (new pools; a new backend instance when the backend is ``shared``) must be
    served from storage: storage hits, so pages made the round trip through L3. The first
    engine serves a short probe last; the fresh engine serves first, alone, the turn whose
    leading pages the store holds, so nothing it writes evicts them before its read. A
    ``bounded`` store that kept no turn's leading page (but keeps its last write) skips it.
``missing_pages``
    Stored pages deleted between two engines (``clear()`` without ``delete``): recomputed.
    Every page the engine stored must still be there to delete, unless the backend declares
    ``bounded`` capacity: then a page it evicted is legitimate and only the pages it still
    reports are deleted (each must be).
``late_pages``
    Reads and existence queries delayed by the fault layer, under ``timeout`` and
    ``best_effort``: requests go ahead with what arrived and recompute the rest. A ``bounded``
    backend that kept too few pages for any fetch to be cut skips the cut requirement.
``failed_loads``
    Reads, writes and existence queries failing at random (the fault layer): misses.
``server_stop`` / ``server_pause``
    With a :class:`~hicache_storage.kit.services.ServerControl`: the server is stopped (or
    paused) mid-run, every request still finishes in time, and after a restart storage serves
    again. ``server_pause`` needs a pausable control and runs only when named in ``cases``.

The verdict does not depend on the machine's load: the check asserts only what it controls
(storage threads at the process's priority, a ``timeout`` deadline far past any read in the
policy cases, and the fresh engine's first read made before anything it writes).

After every engine, the harness requires its threads gone, its radix tree consistent, no lock or
pin left, and every device and host slot either indexed by the tree or free. Each case runs under
a watchdog: a backend call that never returns fails the case instead of hanging the check.

Run it with ``hicache check NAME --engine [--config JSON]``, with
``pytest --hicache-backend NAME --hicache-engine`` (one ``TestEngine`` item per case, beside the
storage suite), by importing :class:`TestEngine` into a test module that defines
``hicache_factory``, or in code::

    report = check_engine(BackendFactory("redis", options), server_control=control)
    report.assert_passed()

Each case writes under a key namespace of its own (the key scheme's model name,
``engine-check-<run>-<case>``), so runs never see each other's pages.
"""

from __future__ import annotations

import functools
import random
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.config import FaultConfig, FaultRule, LayerConfig
from hicache_storage.conformance.checks.common import SHARED_POOLS
from hicache_storage.conformance.report import Outcome
from hicache_storage.engine.build import build_cache
from hicache_storage.engine.cache import CacheConfig, TierCache
from hicache_storage.engine.cache_config import PrefetchConfig, ThreadConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel, ModelConfig
from hicache_storage.engine.policies import PrefetchPolicy, PrefetchTimeout, WritePolicy
from hicache_storage.engine.scheduler import Request
from hicache_storage.engine.workloads import Conversation, MultiTurn
from hicache_storage.errors import ConfigError, UnsupportedOperationError
from hicache_storage.keys import RankSuffixScheme, page_hashes
from hicache_storage.kit.services import PausableServerControl, ServerControl
from hicache_storage.layers import ForwardingBackend

__all__ = [
    "DEFAULT_CASES",
    "POLICIES",
    "SCENARIOS",
    "EngineCheck",
    "EngineReport",
    "LayeredFactory",
    "TestEngine",
    "case_names",
    "check_engine",
    "policy_case",
]

POLICIES: tuple[tuple[WritePolicy, PrefetchPolicy], ...] = (
    (WritePolicy.WRITE_THROUGH, PrefetchPolicy.WAIT_COMPLETE),
    (WritePolicy.WRITE_THROUGH_SELECTIVE, PrefetchPolicy.WAIT_COMPLETE),
    (WritePolicy.WRITE_BACK, PrefetchPolicy.WAIT_COMPLETE),
    (WritePolicy.WRITE_THROUGH, PrefetchPolicy.BEST_EFFORT),
    (WritePolicy.WRITE_THROUGH, PrefetchPolicy.TIMEOUT),
)
"""The policy matrix: every write policy with ``wait_complete``, every prefetch policy with
``write_through`` (not the full cross product)."""

SCENARIOS = (
    "fresh_engine",
    "missing_pages",
    "late_pages",
    "failed_loads",
    "server_stop",
    "server_pause",
)
"""The cases beyond the policy matrix, in the order they run."""

DEFAULT_CASES = tuple(name for name in SCENARIOS if name != "server_pause")
"""The scenarios that run when ``cases`` is not given (a paused server costs a deadline a call)."""

PAGE = 4
"""Tokens per page: short prompts still span many pages."""

DEVICE_TOKENS = 64
HOST_TOKENS = 48
"""Pool sizes: the device holds about one long request, the host a little less, so histories
are evicted to the host and storage and brought back."""

_SLACK_S = 2.0
"""What one call may take past the backend's deadline (scheduling on a loaded machine)."""

_LATE_S = 0.01
"""Delay the fault layer adds to every read and existence query in ``late_pages``."""

_FAILURE_RATE = 0.3
"""Probability that a read, write or existence query fails in ``failed_loads``."""

_PROBE = 2 * PAGE + 1
"""Prompt tokens of ``fresh_engine``'s probe: with its answer, three pages."""

_PROBE_SEED = 48
"""Seeds the probe's tokens (none of the transcript's prefixes)."""

_POLICY_TIMEOUT = PrefetchTimeout(base_s=30.0, per_page_s=0.0)
"""The ``timeout`` policy's deadline in the policy cases: far past any read of a loaded
machine, so the case checks the policy's path, not how fast the machine is (``late_pages``
cuts fetches with a deadline of its own, on delays the fault layer controls)."""


class LayeredFactory(Protocol):
    """Opens a new backend instance over the store under test, wrapped in ``layers``.

    :class:`~hicache_storage.conformance.factory.BackendFactory` is one; so is any function that
    passes ``layers`` on to :func:`~hicache_storage.create_backend`.
    """

    def __call__(self, layers: LayerConfig | None = None) -> StorageBackend:
        """Open an instance (the default layers when ``layers`` is None)."""
        ...


class EngineCheck(msgspec.Struct, kw_only=True):
    """One case: its outcome, why it failed or skipped, how long it took and what it moved."""

    name: str
    outcome: Outcome
    message: str | None = None
    duration_s: float = 0.0
    stats: dict[str, float] = {}


class EngineReport(msgspec.Struct, kw_only=True):
    """Every case of one :func:`check_engine` run."""

    backend: str
    checks: list[EngineCheck] = []
    duration_s: float = 0.0

    def failures(self) -> list[EngineCheck]:
        """Return the cases that failed or errored."""
        return [c for c in self.checks if c.outcome in ("failed", "error")]

    @property
    def passed(self) -> bool:
        """Whether no case failed or errored (skips are fine)."""
        return not self.failures()

    def check(self, name: str) -> EngineCheck:
        """Return the case called ``name``.

        Raises
        ------
        KeyError
            If no case of that name ran.
        """
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def assert_passed(self) -> None:
        """Raise an ``AssertionError`` naming every failed case and why.

        Raises
        ------
        AssertionError
            If a case failed or errored.
        """
        failed = self.failures()
        if failed:
            lines = [f"{c.name} {c.outcome}: {c.message}" for c in failed]
            raise AssertionError(
                f"{len(failed)} engine case(s) of {self.backend} failed:\n" + "\n".join(lines)
            )


def policy_case(write: WritePolicy | str, prefetch: PrefetchPolicy | str) -> str:
    """Return the case name of a policy pair: ``write_back/wait_complete``."""
    return f"{WritePolicy(write).value}/{PrefetchPolicy(prefetch).value}"


def case_names(
    policies: Sequence[tuple[WritePolicy | str, PrefetchPolicy | str]] = POLICIES,
    scenarios: Sequence[str] = SCENARIOS,
) -> list[str]:
    """Return the names of the cases, in the order :func:`check_engine` runs them."""
    return [*(policy_case(w, p) for w, p in policies), *scenarios]


# -- the workload and its oracle ------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    """One request of the transcript and the oracle's answer to it."""

    client: int
    round: int
    prompt: tuple[int, ...]
    expected: tuple[int, ...]

    @property
    def label(self) -> str:
        return "the probe" if self.client < 0 else f"client {self.client} round {self.round}"


@functools.lru_cache(maxsize=4)
def _model(config: ModelConfig) -> LlamaModel:
    return LlamaModel(config)


@functools.lru_cache(maxsize=8)
def _transcript(config: ModelConfig, workload: MultiTurn) -> tuple[tuple[_Turn, ...], ...]:
    """Answer every turn by recomputing everything; each round's prompts hold earlier answers."""
    model = _model(config)
    conversations = [Conversation() for _ in range(workload.clients)]
    rounds: list[list[_Turn]] = [[] for _ in range(workload.rounds)]
    for turn in workload.turns():
        conversation = conversations[turn.client]
        prompt = conversation.prompt(turn)
        answer = model.generate_no_cache(prompt, turn.max_new_tokens)
        conversation.answer(turn, answer)
        rounds[turn.round].append(_Turn(turn.client, turn.round, tuple(prompt), tuple(answer)))
    return tuple(tuple(r) for r in rounds)


class _Skip(Exception):
    """The case does not apply to this backend."""


def _compare(turn: _Turn, got: Sequence[int], phase: str) -> None:
    """Raise an ``AssertionError`` at the first token ``got`` differs from the oracle."""
    expected = turn.expected
    if tuple(got) == expected:
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    have = got[first] if first < len(got) else "nothing"
    want = expected[first] if first < len(expected) else "nothing"
    raise AssertionError(
        f"{phase}: request {turn.label} ({len(turn.prompt)}-token prompt) differs from "
        f"recompute at output token {first}: got {have}, expected {want} "
        f"(got {list(got)}, expected {list(expected)})"
    )


# -- one engine -----------------------------------------------------------------------------------


_COUNTERS = (
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "computed_tokens",
    "pages_stored",
    "pages_fetched",
    "storage_misses",
    "prefetch_pages_cut",
    "backups_failed",
    "pages_dropped",
)
"""The :class:`CacheStats` counters a case reports, summed over its engines."""


class _Case:
    """What every case shares: the model, the transcript, the factory and a key namespace."""

    def __init__(
        self,
        name: str,
        factory: LayeredFactory,
        model: LlamaModel,
        transcript: tuple[tuple[_Turn, ...], ...],
        namespace: str,
    ) -> None:
        self.name = name
        self.factory = factory
        self.model = model
        self.transcript = transcript
        self.scheme = RankSuffixScheme(model_name=namespace)
        self.totals: dict[str, float] = {}
        self.base_layers: LayerConfig = getattr(factory, "layers", None) or LayerConfig()
        self._opened: list[StorageBackend] = []

    def open(self, faults: FaultConfig | None = None) -> StorageBackend:
        """Open an instance (closed when the case ends), with ``faults`` injected if given."""
        layers = self.base_layers
        if faults is not None:
            layers = msgspec.structs.replace(layers, faults=faults)
        backend = self.factory(layers)
        self._opened.append(backend)
        return backend

    def other(self, backend: StorageBackend) -> StorageBackend:
        """Return a second instance over the same store if the backend is shared, else itself."""
        if not backend.capabilities.shared:
            return backend
        return self.open()

    def close(self) -> None:
        for backend in reversed(self._opened):
            backend.close()

    def cache(
        self,
        backend: StorageBackend | None,
        write: WritePolicy = WritePolicy.WRITE_THROUGH,
        prefetch: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE,
        **prefetching: Any,
    ) -> TierCache:
        """Build a cache over fresh pools small enough to evict to the host and storage.

        ``prefetching`` are further :class:`~hicache_storage.engine.cache_config.PrefetchConfig`
        settings. The storage threads run at the process's priority (``threads.nice=None``,
        ``threads.idle_writes=False``): at the engine's defaults they yield to every other
        process, so on a busy machine the writer all but stops, and what storage holds when a
        later request asks would depend on the machine's load, not on the backend.
        """
        longest = max(len(t.prompt) + len(t.expected) for r in self.transcript for t in r)
        device_tokens = max(DEVICE_TOKENS, -(-longest // PAGE) * PAGE)
        if prefetch is PrefetchPolicy.TIMEOUT:
            prefetching.setdefault("timeout", _POLICY_TIMEOUT)
        cache_config = CacheConfig(
            PAGE,
            write=WriteConfig(policy=write),
            prefetch=PrefetchConfig(policy=prefetch, **prefetching),
            threads=ThreadConfig(nice=None, idle_writes=False),
        )
        return build_cache(
            self.model.config,
            cache_config,
            device_tokens=device_tokens,
            host_tokens=HOST_TOKENS,
            backend=backend,
            pin_memory=False,
            shared_host=SHARED_POOLS,
            scheme=self.scheme,
        )

    def serve(
        self,
        cache: TierCache,
        phase: str,
        rounds: Sequence[Sequence[_Turn]] | None = None,
        between: Callable[[int], None] | None = None,
    ) -> TierCache:
        """Serve ``rounds`` (every round by default), each as one batch; close and audit.

        ``between(i)`` runs before round ``i``. Every answer is compared with the oracle.
        """
        engine = Engine(self.model, cache)
        try:
            for i, turns in enumerate(self.transcript if rounds is None else rounds):
                if between is not None:
                    between(i)
                requests = [Request(t.prompt, len(t.expected), tag=t) for t in turns]
                for request, turn in zip(engine.serve(requests), turns, strict=True):
                    _compare(turn, request.output, phase)
        finally:
            engine.close()
        for name in _COUNTERS:
            self.totals[name] = self.totals.get(name, 0) + getattr(cache.stats, name)
        _audit(cache, phase)
        return cache


def _audit(cache: TierCache, phase: str) -> None:
    """Require a closed cache to hold no thread, lock, pin or stray slot, and a sound tree."""
    alive = [getattr(t, "name", repr(t)) for t in cache.threads if _is_alive(t)]
    assert not alive, f"{phase}: threads of the cache outlived close(): {alive}"
    cache.tree.check()
    tree = cache.tree
    assert tree.locked_tokens == 0, f"{phase}: {tree.locked_tokens} tokens still locked"
    pinned = [n for n in tree.nodes() if n.host_pins]
    assert not pinned, f"{phase}: {len(pinned)} nodes still pinned on the host"
    nodes = list(tree.nodes())
    on_device = sum(n.num_tokens for n in nodes if n.device_indices is not None)
    free = cache.device_alloc.available_size()
    size = cache.device_pool.size
    assert on_device + free == size, (
        f"{phase}: device slots leaked: {on_device} indexed + {free} free != {size}"
    )
    pool = cache.host_pool
    if pool is not None:
        on_host = sum(n.num_tokens for n in nodes if n.host_indices is not None)
        free = pool.allocator.available_size()
        assert on_host + free == pool.size, (
            f"{phase}: host slots leaked: {on_host} indexed + {free} free != {pool.size}"
        )


def _is_alive(thread: object) -> bool:
    alive = getattr(thread, "is_alive", None)
    return bool(alive()) if callable(alive) else False


def _faults_fired(backend: StorageBackend) -> int:
    section = backend.stats().get("faults", {})
    return int(sum(section.values())) if isinstance(section, dict) else 0


# -- the cases ------------------------------------------------------------------------------------


def _policy(case: _Case, write: WritePolicy, prefetch: PrefetchPolicy) -> None:
    backend = case.open()
    warm = case.serve(case.cache(backend, write, prefetch), "warm engine")
    stats = warm.stats
    assert stats.pages_backed_up > 0, "the warm engine never evicted to the host (harness bug)"
    # best_effort waits for nothing: whether a page is still on the 12-page host pool when a
    # request asks for it depends on how fast the writes drain, so only the waiting policies
    # must hit below the device; and only over a store that keeps what it was given (a bounded
    # one may have evicted every page before it is asked again, and then the host's alone
    # depend on the writes' pace).
    assert (
        prefetch is PrefetchPolicy.BEST_EFFORT
        or backend.capabilities.bounded
        or stats.host_hit_tokens + stats.storage_hit_tokens > 0
    ), "the warm engine never hit below the device (harness bug)"
    assert stats.pages_stored > 0, (
        f"no page was written to storage under {write.value} "
        f"({stats.backups_failed} failed, {stats.backups_refused} refused)"
    )
    case.serve(case.cache(case.other(backend), write, prefetch), "fresh engine")


def _fresh_engine(case: _Case) -> None:
    """Require a fresh engine's first request, served alone, to read the stored leading pages.

    Which pages a bounded store still holds when the first engine closes depends on how its
    writes and reads interleaved, and a request served beside others may find pages that their
    write-throughs evict before its read: neither is the backend's fault, and both depend on the
    machine's load. So the first engine serves a short probe last, alone (its pages are the
    last written: a least-recently-used store that holds a few pages holds those), the store is
    asked which turn's leading pages it holds, and the fresh engine serves that turn alone
    before the transcript: nothing of its own is written between its query and its read, and
    every page it found must be read. A bounded store that holds no turn's leading page skips
    the case (an unbounded one fails it).
    """
    tokens = random.Random(_PROBE_SEED).choices(range(case.model.config.vocab_size), k=_PROBE)
    answer = tuple(case.model.generate_no_cache(tokens, 4))
    probe = _Turn(client=-1, round=-1, prompt=tuple(tokens), expected=answer)
    backend = case.open()
    recorder = _Recorder(backend)
    first = case.serve(case.cache(recorder), "first engine", [*case.transcript, [probe]])
    assert first.stats.pages_stored > 0, (
        f"the first engine stored no page ({first.stats.backups_failed} failed)"
    )
    other = case.other(backend)
    turns = [probe, *(turn for turns in case.transcript for turn in turns)]
    held = [other.batch_exists(first.scheme.keys(page_hashes(t.prompt, PAGE))) for t in turns]
    if max(held) == 0:
        kept = other.batch_exists(recorder.stored[-1:])
        assert backend.capabilities.bounded and kept, (
            f"storage holds no leading page of any turn the first engine served "
            f"({first.stats.pages_stored} pages stored; its last write "
            f"{'kept' if kept else 'gone'})"
        )
        raise _Skip(
            "the bounded store kept no turn's leading page for a fresh engine to read; its "
            "last write is there and the answers matched"
        )
    lead = turns[held.index(max(held))]
    fresh = case.serve(case.cache(other), "fresh engine", rounds=[[lead], *case.transcript])
    stats = fresh.stats
    assert stats.storage_hit_tokens > 0 and stats.pages_fetched > 0, (
        f"a fresh engine whose first request ({lead.label}) storage holds {max(held)} leading "
        f"pages of got no storage hit ({stats.storage_misses} pages found but not read): "
        "nothing made the L3 round trip"
    )
    case.totals["fresh_storage_hit_tokens"] = stats.storage_hit_tokens


class _Recorder(ForwardingBackend):
    """Remembers every key a page write stored, in order."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.stored: list[str] = []
        self._lock = threading.Lock()

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]
    ) -> list[bool]:
        done = self.inner.batch_set_v1(keys, host_indices)
        with self._lock:
            self.stored.extend(key for key, ok in zip(keys, done, strict=False) if ok)
        return done


def _missing_pages(case: _Case) -> None:
    backend = case.open()
    recorder = _Recorder(backend)
    case.serve(case.cache(recorder), "first engine")
    keys = list(dict.fromkeys(recorder.stored))
    assert keys, "the first engine stored no page"
    if backend.capabilities.delete:
        # Every third page: fetches stop at the gap, the pages after it are recomputed.
        gone = keys[1::3]
        bounded = backend.capabilities.bounded
        if bounded:  # a bounded store may evict pages: no loss, and nothing to delete
            kept = [key for key in gone if backend.exists(key)]
            case.totals["evicted_pages"] = len(gone) - len(kept)
            gone = kept
        deleted = sum(backend.delete(key) for key in gone)
        note = " that exists() still reported" if bounded else ""
        assert deleted == len(gone), f"delete() found {deleted} of {len(gone)} stored pages{note}"
    else:
        try:
            backend.clear()
        except UnsupportedOperationError:
            raise _Skip("the backend can neither delete nor clear") from None
        deleted = len(keys)
    case.totals["deleted_pages"] = deleted
    case.serve(case.cache(case.other(backend)), "engine after the deletion")


def _late_pages(case: _Case) -> None:
    faults = FaultConfig(
        seed=17,
        ops={
            "batch_get_v1": FaultRule(delay_s=_LATE_S),
            "batch_exists": FaultRule(delay_s=_LATE_S),
        },
    )
    backend = case.open(faults)
    case.serve(case.cache(backend, prefetch=PrefetchPolicy.BEST_EFFORT), "first engine")
    # One page a read, so a deadline falls between pages and part of a fetch is used.
    timeout = PrefetchTimeout(base_s=2.5 * _LATE_S, per_page_s=0.0)
    for prefetch in (PrefetchPolicy.TIMEOUT, PrefetchPolicy.BEST_EFFORT):
        cache = case.cache(backend, prefetch=prefetch, timeout=timeout, read_batch_pages=1)
        case.serve(cache, f"{prefetch.value} engine")
    cut = case.totals.get("prefetch_pages_cut", 0)
    if cut == 0 and backend.capabilities.bounded:
        raise _Skip(
            f"the bounded store kept too few pages for a late one to cut a fetch short "
            f"({case.totals.get('pages_fetched', 0):g} pages fetched); the answers matched"
        )
    assert cut > 0, "no prefetch was cut short: no page was late"


def _failed_loads(case: _Case) -> None:
    rule = FaultRule(failure_rate=_FAILURE_RATE)
    ops = {op: rule for op in ("batch_get_v1", "batch_set_v1", "batch_exists")}
    backend = case.open(FaultConfig(seed=23, default=rule, ops=ops))
    case.serve(case.cache(backend), "first engine")
    case.serve(case.cache(backend), "fresh engine")
    fired = _faults_fired(backend)
    case.totals["faults"] = fired
    assert fired > 0, "the fault layer never fired"


def _server_deadline(control: ServerControl, factory: LayeredFactory) -> float:
    """Return the longest one call may take with the server down (the conformance suite's)."""
    value = getattr(control, "timeout_s", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    options = getattr(factory, "options", None) or {}
    for name in ("deadline_s", "timeout_s", "op_timeout_s", "request_timeout_s", "timeout"):
        option = options.get(name)
        if isinstance(option, (int, float)) and not isinstance(option, bool):
            return float(option)
    return 5.0


def _server_fault(case: _Case, control: ServerControl | None, pause: bool) -> None:
    if control is None:
        raise _Skip("no server control (a plugin's hicache_conformance_server hook provides one)")
    down, up = control.stop, control.start
    if pause:
        if not isinstance(control, PausableServerControl):
            raise _Skip("the server control has no pause()/resume()")
        down, up = control.pause, control.resume
    state = "paused" if pause else "stopped"
    rounds = case.transcript
    outage = len(rounds) // 2
    requests = len(rounds[outage])
    deadline = _server_deadline(control, case.factory)
    # Each request may wait for its existence query, and the round for one write that makes
    # room, each up to the deadline (a stopped server refuses at once, a paused one never answers).
    bound = (requests + 1) * (deadline + _SLACK_S)
    outage_s = _Outage(up, bound)

    def between(i: int) -> None:
        if i == outage:
            down()
            outage_s.begin()
        elif i == outage + 1:
            outage_s.end()

    backend = case.open()
    try:
        cache = case.cache(backend)
        case.serve(cache, f"engine across the {state} server", rounds[: outage + 2], between)
    finally:
        outage_s.end()
    case.totals["outage_round_s"] = round(outage_s.round_s, 3)
    assert not outage_s.forced, (
        f"with the server {state}, round {outage} ({requests} requests) was still running "
        f"after {bound:.1f} s (a {deadline:g} s deadline a call): the engine waited for storage "
        f"instead of missing ({cache.stats.backups_failed} page writes failed meanwhile); it "
        f"finished {max(outage_s.after_back_s, 0.0):.1f} s after the server was back"
    )
    # Recovery: after the restart, pages are written and read again.
    fresh = case.serve(case.cache(case.other(backend)), "engine after the restart")
    again = case.serve(case.cache(case.other(backend)), "fresh engine after the restart")
    assert fresh.stats.pages_stored > 0, "no page was stored after the restart"
    assert again.stats.storage_hit_tokens > 0, (
        "no storage hit after the restart: storage never recovered"
    )


class _Outage:
    """Times a round with the server down; brings the server back after ``bound_s`` at most.

    A round that outlives the bound is a hang: the server is restarted under it, so the round
    finishes and the case reports it rather than waiting for the watchdog.
    """

    def __init__(self, up: Callable[[], None], bound_s: float) -> None:
        self._up = up
        self._bound_s = bound_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._began: float | None = None
        self._restored = False
        self._ended = False
        self.round_s = 0.0
        self.forced = False
        self.back_at = 0.0

    def begin(self) -> None:
        """Start timing: the server was just taken down."""
        self._began = time.monotonic()
        self._timer = threading.Timer(self._bound_s, self._force)
        self._timer.daemon = True
        self._timer.start()

    def end(self) -> None:
        """Stop timing (the first call counts) and bring the server back unless it is."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._began is None or self._ended:
                return
            self._ended = True
            self.round_s = time.monotonic() - self._began
            if not self._restored:
                self._restored = True
                self._up()

    @property
    def after_back_s(self) -> float:
        """Seconds the round ran on after a forced restart had brought the server back."""
        assert self._began is not None
        return self._began + self.round_s - self.back_at

    def _force(self) -> None:
        with self._lock:
            if not self._restored:
                self.forced = True
                self._restored = True
                self._up()
                self.back_at = time.monotonic()


# -- the runner -----------------------------------------------------------------------------------


def _within(limit_s: float, body: Callable[[], None]) -> None:
    """Run ``body`` in a daemon thread; raise what it raised, or ``TimeoutError`` past the limit.

    A body still running at the limit is left behind (it is stuck in a call that never returns).
    """
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed over to the caller's thread
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=target, name="hicache-engine-case", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise TimeoutError(
            f"did not finish within {limit_s:g} s: a storage call or the engine hung"
        )
    if outcome[0] is not None:
        raise outcome[0]


def _runner(
    name: str,
    control: ServerControl | None,
) -> Callable[[_Case], None]:
    if "/" in name:
        write, _, prefetch = name.partition("/")
        return lambda case: _policy(case, WritePolicy(write), PrefetchPolicy(prefetch))
    scenarios: dict[str, Callable[[_Case], None]] = {
        "fresh_engine": _fresh_engine,
        "missing_pages": _missing_pages,
        "late_pages": _late_pages,
        "failed_loads": _failed_loads,
        "server_stop": lambda case: _server_fault(case, control, pause=False),
        "server_pause": lambda case: _server_fault(case, control, pause=True),
    }
    return scenarios[name]


def check_engine(
    factory: LayeredFactory,
    *,
    policies: Sequence[tuple[WritePolicy | str, PrefetchPolicy | str]] = POLICIES,
    cases: Collection[str] | None = None,
    server_control: ServerControl | None = None,
    model_config: ModelConfig | None = None,
    clients: int = 3,
    rounds: int = 4,
    seed: int = 0,
    case_timeout_s: float = 120.0,
    progress: Callable[[EngineCheck], None] | None = None,
) -> EngineReport:
    """Serve conversations through engines over the backend; every token must match recompute.

    Parameters
    ----------
    factory
        Opens a new instance over the store under test, given its layers (a
        :class:`~hicache_storage.conformance.factory.BackendFactory`, for one).
    policies
        The ``(write policy, prefetch policy)`` pairs of the policy cases.
    cases
        Names of the cases to run (see :func:`case_names`); by default every policy case and
        :data:`DEFAULT_CASES`.
    server_control
        Stops and restarts the backend's server for ``server_stop`` (and pauses it for
        ``server_pause``); without it those cases are skipped.
    model_config
        The model; :meth:`ModelConfig.tiny` by default.
    clients, rounds, seed
        The conversations: ``clients`` histories of ``rounds`` turns each.
    case_timeout_s
        The longest a case may run before it fails as hung.
    progress
        Called with each case's result as soon as it is known.

    Returns
    -------
    EngineReport
        One :class:`EngineCheck` per case, in :func:`case_names` order.

    Raises
    ------
    ConfigError
        If ``cases`` names an unknown case, or there are fewer than 3 rounds (a server case
        takes it down in one and brings it back before another).
    """
    started = time.monotonic()
    if rounds < 3:
        raise ConfigError(f"the engine check needs at least 3 rounds, got {rounds}")
    names = case_names(policies, SCENARIOS)
    if cases is None:
        wanted = [n for n in names if "/" in n or n in DEFAULT_CASES]
    else:
        unknown = sorted(set(cases) - set(names))
        if unknown:
            raise ConfigError(f"unknown engine cases {unknown}; known: {', '.join(names)}")
        wanted = [n for n in names if n in cases]
    config = model_config or ModelConfig.tiny()
    workload = MultiTurn(
        clients,
        rounds,
        system_tokens=3 * PAGE + 1,
        turn_tokens=(3, 8),
        max_new_tokens=4,
        vocab_size=config.vocab_size,
        seed=seed,
    )
    model = _model(config)
    transcript = _transcript(config, workload)
    run_id = secrets.token_hex(4)
    report = EngineReport(backend=str(getattr(factory, "name", None) or "custom"))
    for index, name in enumerate(wanted):
        case = _Case(name, factory, model, transcript, f"engine-check-{run_id}-{index}")
        body = _runner(name, server_control)
        t0 = time.monotonic()
        outcome: Outcome = "passed"
        message: str | None = None
        try:
            _within(case_timeout_s, functools.partial(_run_case, case, body))
        except _Skip as exc:
            outcome, message = "skipped", str(exc)
        except AssertionError as exc:
            outcome, message = "failed", str(exc)
        except Exception as exc:  # noqa: BLE001 - a case's crash is its result
            outcome, message = "error", f"{type(exc).__name__}: {exc}"
        check = EngineCheck(
            name=name,
            outcome=outcome,
            message=message,
            duration_s=time.monotonic() - t0,
            stats=dict(case.totals),
        )
        report.checks.append(check)
        if progress is not None:
            progress(check)
    report.duration_s = time.monotonic() - started
    return report


def _run_case(case: _Case, body: Callable[[_Case], None]) -> None:
    try:
        body(case)
    finally:
        case.close()


class TestEngine:
    """The engine check as pytest items: one per case, against ``hicache_factory``.

    Collected by ``pytest --hicache-backend NAME --hicache-engine`` or imported into a test
    module that defines ``hicache_factory``; the pytest plugin supplies the
    ``hicache_engine_check`` fixture (one parametrized item per case).
    """

    def test_engine_case_matches_recompute(self, hicache_engine_check: EngineCheck) -> None:
        """Require the case to pass: same tokens as recompute, nothing left behind."""
        assert hicache_engine_check.outcome == "passed", (
            f"{hicache_engine_check.name}: {hicache_engine_check.message}"
        )
