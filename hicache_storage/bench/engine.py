"""What each tier of the KV cache buys: one seeded workload served over four cache configurations.

:func:`run_bench` builds one model and serves the same workload four times, each over fresh pools:

1. ``no-cache``: every prompt token recomputed (``CacheConfig(prefix_cache=False)``);
2. ``L1``: a radix cache on the device pool alone, which loses what it evicts;
3. ``L1+L2``: the same device pool backed by a host pool;
4. ``L1+L2+L3``: the same device and host pools backed by a storage backend, cleared first.

The device pool is the same in every configuration and the host pool the same in the last two,
so the differences between rows are what each tier adds. The workload is driven in wall-clock time:
a turn is submitted once its arrival time has come, its client's previous turn has finished and
(with a concurrency bound) a slot is free; it is stamped as arriving at the latest of the three,
so TTFT includes queueing as it would in serving. On a GPU the copy kernels are compiled before
each configuration's clock starts, so that no configuration pays for compiles in its load time.
Every configuration must produce the no-cache configuration's tokens; ``RunResult.identical``
says whether it did (in bfloat16, rounding differences between a cached and a recomputed prefix
may flip greedy tokens; ``RunResult.matching_outputs`` counts the requests that agree).

The result is made of dataclasses that msgspec encodes: :meth:`BenchResult.to_json` and
:meth:`BenchResult.from_json` round-trip it, with secrets in the backend options masked.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.metadata
import math
import platform
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.config import FaultConfig, FaultRule, LayerConfig, check_duration
from hicache_storage.engine.build import build_cache, check_memory
from hicache_storage.engine.cache import CacheConfig, TierCache
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import DTYPES, LlamaModel, ModelConfig
from hicache_storage.engine.scheduler import Request, StepRecord
from hicache_storage.engine.workloads import Conversation, DocumentQueries, MultiTurn, Turn
from hicache_storage.errors import (
    ConfigError,
    HostPoolError,
    MissingDependencyError,
    UnsupportedOperationError,
)
from hicache_storage.factory import create_backend
from hicache_storage.hostpool.layout import Layout
from hicache_storage.kit.options import positive_int
from hicache_storage.redact import redact_options, redacted_repr

from .settings import apply_settings

__all__ = [
    "PARTS",
    "EXTRA_RUNS",
    "RUNS",
    "BenchConfig",
    "BenchResult",
    "EngineSettings",
    "MachineRates",
    "Progress",
    "RequestRecord",
    "RunResult",
    "RunSummary",
    "Spread",
    "Workload",
    "plot_ttft_by_round",
    "run_bench",
    "run_benches",
]

Progress = Callable[[str, int, int], None]
"""Called with a configuration's name, its finished requests and its total requests."""

RUNS: tuple[tuple[str, str], ...] = (
    ("no-cache", "every prompt token recomputed"),
    ("L1", "device radix cache"),
    ("L1+L2", "device + host pool"),
    ("L1+L2+L3", "device + host pool + storage"),
)
"""The four configurations, in the order they run: name and description."""

EXTRA_RUNS: tuple[tuple[str, str], ...] = (
    (
        "L1+L2+L3-unverified",
        "L1+L2+L3 without end-to-end page verification (what verification costs)",
    ),
)
"""Configurations that run only when named in ``runs``, after the four."""

_MODELS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": ModelConfig.tiny,
    "8b": ModelConfig.llama3_8b,
    "70b-layers": ModelConfig.llama3_70b_layers,
}
"""Named shapes; ``--model`` also takes a Hugging Face ``config.json`` (its shape, 8b's sizes)."""

_WARM_COUNTS = 64
"""Page counts up to which every count of a copy is compiled ahead (see ``_warm_transfer``)."""


@dataclass(frozen=True)
class Workload:
    """What the clients send: seeded prompts, how many, how long, and when.

    Attributes
    ----------
    kind
        ``multiturn`` (:class:`~hicache_storage.engine.workloads.MultiTurn`) or ``documents``
        (:class:`~hicache_storage.engine.workloads.DocumentQueries`).
    clients, rounds
        Conversations and rounds each; or documents and queries of each document, a document's
        queries sent one after another (query ``i`` is round ``i``).
    system_tokens, turn_tokens
        Multi-turn: the shared system prompt and the (low, high) length of a new turn.
    document_tokens, question_tokens
        Documents: a document's length and a question's.
    max_new_tokens
        Tokens generated per request.
    arrival_rate
        Requests per second of a Poisson arrival process; None sends every first turn at once.
    concurrency
        Most requests in flight (submitted, not finished); None for no bound. With 1 and no
        ``arrival_rate`` the turns run one at a time in order, and the hits are deterministic.
    seed
        Seed of the prompts and arrivals (the model's weights are always seeded 0).
    """

    kind: str = "multiturn"
    clients: int = 8
    rounds: int = 4
    system_tokens: int = 48
    turn_tokens: tuple[int, int] = (16, 40)
    document_tokens: int = 128
    question_tokens: int = 16
    max_new_tokens: int = 8
    arrival_rate: float | None = None
    concurrency: int | None = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("multiturn", "documents"):
            raise ConfigError(f"workload.kind must be multiturn or documents, got {self.kind!r}")
        for name in (
            "clients",
            "rounds",
            "system_tokens",
            "document_tokens",
            "question_tokens",
            "max_new_tokens",
        ):
            positive_int(f"workload.{name}", getattr(self, name), ConfigError)
        low, high = self.turn_tokens
        if not 1 <= low <= high:
            raise ConfigError(
                f"workload.turn_tokens must be (low, high) with 1 <= low <= high, got {low, high}"
            )
        if self.concurrency is not None and (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise ConfigError(
                f"workload.concurrency must be a positive int or None, got {self.concurrency!r}"
            )
        if self.arrival_rate is not None and not 0 < self.arrival_rate < math.inf:
            raise ConfigError(
                f"workload.arrival_rate must be a positive finite rate, got {self.arrival_rate}"
            )

    def turns(self, vocab_size: int) -> list[Turn]:
        """Return the workload's turns in arrival order (the same for every configuration)."""
        if self.kind == "multiturn":
            return list(
                MultiTurn(
                    self.clients,
                    self.rounds,
                    system_tokens=self.system_tokens,
                    turn_tokens=self.turn_tokens,
                    max_new_tokens=self.max_new_tokens,
                    vocab_size=vocab_size,
                    rate_per_s=self.arrival_rate,
                    seed=self.seed,
                ).turns()
            )
        docs = DocumentQueries(
            self.clients,
            self.rounds,
            document_tokens=self.document_tokens,
            question_tokens=self.question_tokens,
            max_new_tokens=self.max_new_tokens,
            vocab_size=vocab_size,
            seed=self.seed,
        )
        # Query i of document d becomes round i of client d, so TTFT by round shows reuse.
        rng = random.Random(self.seed + 1)
        clock = 0.0
        turns = []
        for turn in docs.turns():
            if self.arrival_rate is not None:
                clock += rng.expovariate(self.arrival_rate)
            turns.append(
                dataclasses.replace(
                    turn,
                    client=turn.client % self.clients,
                    round=turn.client // self.clients,
                    arrival_s=clock,
                )
            )
        return turns


@dataclass(frozen=True)
class EngineSettings:
    """The engine around the cache: its pools' sizes and its scheduler's bounds.

    Attributes
    ----------
    device_tokens, host_tokens
        Device pool (L1) and host pool (L2) sizes in tokens, each whole pages of the cache's
        ``page_size``.
    host_layout
        The host pool's layout (:class:`~hicache_storage.hostpool.layout.Layout`).
    chunk_tokens, max_running
        The scheduler's prefill chunk and batch bounds.
    managed_gc
        The scheduler runs the garbage collector between steps, over the objects made after
        the warm-up (the engine's option of that name).
    """

    device_tokens: int = 256
    host_tokens: int = 512
    host_layout: Layout = Layout.LAYER_FIRST
    chunk_tokens: int = 256
    max_running: int = 64
    managed_gc: bool = True

    def __post_init__(self) -> None:
        for name in ("device_tokens", "host_tokens", "chunk_tokens", "max_running"):
            positive_int(f"engine.{name}", getattr(self, name), ConfigError)
        if not isinstance(self.managed_gc, bool):
            raise ConfigError(f"engine.managed_gc must be a bool, got {self.managed_gc!r}")
        try:
            object.__setattr__(self, "host_layout", Layout.parse(self.host_layout))
        except HostPoolError as exc:
            raise ConfigError(f"engine.host_layout: {exc}") from None


_MODEL_DEFAULTS: dict[str, tuple[Workload, EngineSettings, CacheConfig]] = {
    # 8 histories growing to ~200 tokens (~1.4k distinct tokens in all) against a 256-token
    # device pool and a 512-token host pool (which also holds copies of device pages): L1 keeps
    # the system prompt and the latest histories, L2 a few more, L3 the rest. Two requests in
    # flight at a time, closed loop; a few seconds on a CPU.
    "tiny": (Workload(), EngineSettings(), CacheConfig(8)),
    # Llama-3-8B (128 KiB of KV a token) on one large GPU: 16 histories growing to ~5k tokens
    # (~57k distinct tokens, 7 GiB of KV) against a 2 GiB device pool and a 4 GiB host pool.
    "8b": (
        Workload(
            clients=16,
            rounds=6,
            system_tokens=2048,
            turn_tokens=(256, 768),
            document_tokens=8192,
            question_tokens=64,
            max_new_tokens=64,
            concurrency=4,
        ),
        EngineSettings(device_tokens=16384, host_tokens=32768, chunk_tokens=8192),
        CacheConfig(64),
    ),
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines a benchmark run; the defaults are the ``tiny`` model's.

    :meth:`for_model` gives another model's default sizes; :meth:`with_settings` changes any
    field by its dotted path (``workload.clients``, ``write.policy``).

    Attributes
    ----------
    backend, backend_config
        The storage backend of ``L1+L2+L3`` and its options (see
        :func:`~hicache_storage.create_backend`); it is built with the default layers.
    model
        ``tiny`` (a CPU-sized float32 model), ``8b`` (Llama-3-8B's shape in bfloat16),
        ``70b-layers`` (20 layers of Llama-3-70B's shape: its compute per KV byte on one GPU), or
        the path of a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3; the shape with
        seeded random weights), so a user measures their own model's compute per KV byte.
    device
        Where the model and the device pool live (``cpu`` or ``cuda``, ``cuda:1``...).
    dtype
        The model's and the pools' dtype (``float32``, ``bfloat16``, ``float16``); None for the
        model's own (float32 for ``tiny``, bfloat16 for ``8b``). In bfloat16 a cached prefix and
        a recomputed one differ in rounding, which can change greedy tokens of random weights.
    workload
        What the clients send (:class:`Workload`).
    engine
        The pools' sizes and the scheduler's bounds (:class:`EngineSettings`).
    cache
        The tier cache's own config (:class:`~hicache_storage.engine.cache.CacheConfig`), page
        size included. Its ``prefix_cache`` is the bench's to set: off for ``no-cache`` alone.
    faults
        Fault injection on the storage backend (:class:`~hicache_storage.config.FaultConfig`):
        a failing or slow store; ``read_delay_s``, when set, is added as ``batch_get_v1``'s delay.
    read_delay_s
        Seconds the fault layer adds before every ``batch_get_v1`` of the storage backend: a
        slow store, to see that the prefetch policy does not wait for it.
    repeat
        Times every configuration is served (in turn, so drift spreads over all of them); the
        tables give the median and the spread.
    warmup
        Before each configuration's first run, serve as many clients as run at once through
        every round on a throwaway cache of that configuration, untimed: the forwards of the
        workload's shapes, not only the model's largest, are then paid before the clock.
    """

    backend: str = "memory"
    backend_config: dict[str, Any] | None = None
    model: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None
    workload: Workload = field(default_factory=Workload)
    engine: EngineSettings = field(default_factory=EngineSettings)
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(8))
    faults: FaultConfig | None = None
    read_delay_s: float | None = None
    repeat: int = 1
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.model not in _MODELS:
            _read_hf_config(self.model)
        for name, kind in (
            ("workload", Workload),
            ("engine", EngineSettings),
            ("cache", CacheConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not self.cache.prefix_cache:
            raise ConfigError(
                "cache.prefix_cache is the bench's to set: its no-cache configuration runs "
                "without one"
            )
        positive_int("repeat", self.repeat, ConfigError)
        if not isinstance(self.warmup, bool):
            raise ConfigError(f"warmup must be a bool, got {self.warmup!r}")
        check_duration("read_delay_s", self.read_delay_s, allow_zero=True, allow_none=True)
        page = self.cache.page_size
        for name in ("device_tokens", "host_tokens"):
            size = getattr(self.engine, name)
            if size % page:
                raise ConfigError(f"engine.{name} ({size}) must be whole {page}-token pages")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"invalid device {self.device!r}: {exc}") from None

    def __repr__(self) -> str:
        return redacted_repr(self)

    @classmethod
    def for_model(cls, model: str, **overrides: Any) -> BenchConfig:
        """Return the config of ``model`` with its default sizes; ``overrides`` replace fields.

        Raises
        ------
        ConfigError
            If ``model`` is unknown or a field is invalid.
        """
        if model not in _MODELS:
            _read_hf_config(model)
        workload, engine, cache = _MODEL_DEFAULTS["tiny" if model == "tiny" else "8b"]
        defaults = {"workload": workload, "engine": engine, "cache": cache}
        return cls(model=model, **{**defaults, **overrides})

    def with_settings(self, settings: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> BenchConfig:
        """Return this config with ``settings`` applied: values by dotted path, in order.

        ``settings`` is a mapping or (path, value) pairs. A path names a field (``repeat``) or a
        group's field (``workload.clients``); the cache's own settings may leave out ``cache.``
        (``write.policy``, ``page_size``). A value is converted to its field's type
        (``"write_back"`` to a write policy, a list to a tuple); nested mappings work as paths
        do (``{"workload": {"clients": 4}}``). See
        :func:`~hicache_storage.bench.settings.apply_settings`.

        Raises
        ------
        ConfigError
            If a path names no field (the message lists the fields there) or a value is invalid.
        """
        return apply_settings(self, settings, inline="cache")

    def model_config(self) -> ModelConfig:
        """Return the model's shape (in ``dtype`` when set)."""
        named = _MODELS.get(self.model)
        shape = (
            ModelConfig.from_hf_config(_read_hf_config(self.model)) if named is None else named()
        )
        if self.dtype is None:
            return shape
        return dataclasses.replace(shape, dtype=DTYPES[self.dtype])


def _read_hf_config(path: str) -> dict[str, Any]:
    """Return a ``config.json``'s fields, or refuse a model that is neither named nor a file."""
    try:
        with open(path, "rb") as source:
            data = msgspec.json.decode(source.read())
    except FileNotFoundError:
        raise ConfigError(
            f"model must be one of {sorted(_MODELS)} or a config.json path, got {path!r}"
        ) from None
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"model config {path!r} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path!r} is not a JSON object")
    ModelConfig.from_hf_config(data)
    return data


@dataclass
class RequestRecord:
    """One served turn: who, when (seconds from the start), what the cache gave, its output.

    The ``*_s`` parts say where the time to its first token went (see
    :attr:`Request.timings <hicache_storage.engine.scheduler.Request.timings>`); ``bound_s`` is
    the least that time could be on this machine: its storage bytes at the raw parallel read
    rate, its cached bytes over the host-to-device link, and its suffix at the measured
    compute rate (:class:`MachineRates`).
    """

    client: int
    round: int
    arrival_s: float
    ttft_s: float
    finished_s: float
    prompt_tokens: int
    device_hit: int
    host_hit: int
    storage_hit: int
    output: list[int]
    storage_found: int = 0
    storage_query_s: float = 0.0
    storage_read_s: float = 0.0
    queue_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    bound_s: float | None = None


PARTS = ("storage_query", "storage_read", "queue", "load", "compute")
"""Where a request's time to first token goes, in order."""


@dataclass
class MachineRates:
    """What this machine does at best, measured before the runs; the per-request bound's terms.

    Attributes
    ----------
    raw_read_gbps
        The backend's raw baseline reading the model's pages (page_size tokens of KV each) with
        its own parallelism (GB/s); None when the backend has no baseline.
    host_to_device_gbps
        One contiguous copy of those bytes from pinned host memory to the device (on a CPU,
        a plain copy).
    compute_s_per_token
        Prefill seconds per token of the no-cache configuration (its forwards' mean).
    """

    raw_read_gbps: float | None
    host_to_device_gbps: float
    compute_s_per_token: float | None = None

    def bound_s(self, record: RequestRecord, token_bytes: int) -> float | None:
        """Return the least time to ``record``'s first token, or None if a rate is missing."""
        if self.compute_s_per_token is None:
            return None
        storage = record.storage_hit * token_bytes
        if storage and self.raw_read_gbps is None:
            return None
        read = storage / (self.raw_read_gbps * 1e9) if storage and self.raw_read_gbps else 0.0
        cached = (record.host_hit + record.storage_hit) * token_bytes
        link = cached / (self.host_to_device_gbps * 1e9)
        computed = record.prompt_tokens - record.device_hit - record.host_hit - record.storage_hit
        return read + link + computed * self.compute_s_per_token


@dataclass
class RunResult:
    """What one configuration did: hits, latency, throughput, storage traffic, loads.

    ``identical`` says whether every output equals the no-cache configuration's;
    ``matching_outputs`` and ``matching_first_tokens`` count the requests whose whole output,
    or first token, does. Token counts are prompt tokens: ``computed_tokens`` were prefilled,
    the hits were reused.
    ``repeat`` numbers the run among the configuration's repeats; ``costs`` are the engine's
    measured rates at the end (:class:`~hicache_storage.planner.rates.CostModel`);
    ``parts_mean_s`` is the mean of each part of the time to first token (:data:`PARTS`),
    ``bound_mean_s`` the mean per-request bound and ``ttft_over_bound`` mean TTFT over it.
    Times are seconds; ``ttft_by_round_s[i]`` is the mean TTFT of round ``i``. The exposed load
    time is what the forward waited for L2→L1 loads (all of it on a CPU); per layer it is over
    every layer of every load, and the fraction is exposed over total load time (None without
    loads). ``cache`` is the cache's :class:`~hicache_storage.engine.cache.CacheStats`.
    """

    name: str
    description: str
    identical: bool
    matching_outputs: int
    matching_first_tokens: int
    requests: int
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_by_round_s: list[float | None]
    wall_s: float
    generated_tokens_per_s: float
    total_tokens_per_s: float
    storage_bytes_read: int
    storage_bytes_written: int
    loads: int
    load_s: float
    exposed_load_s: float
    exposed_per_layer_s: float | None
    exposed_fraction: float | None
    forwards: int
    storage_cleared: bool | None
    cache: dict[str, Any]
    records: list[RequestRecord] = field(repr=False)
    repeat: int = 0
    costs: dict[str, float | None] = field(default_factory=dict)
    parts_mean_s: dict[str, float] = field(default_factory=dict)
    bound_mean_s: float | None = None
    ttft_over_bound: float | None = None
    steps: list[StepRecord] = field(default_factory=list, repr=False)
    """Every scheduler step, ``started`` in seconds from the run's start."""
    storage_stats: dict[str, Any] = field(default_factory=dict)
    """The backend's calls (``ops``: per operation, calls, hits and misses, latency), and what
    went wrong where anything did (``degraded``: failures the layers turned into misses;
    ``integrity_failures``); for a chain, each tier's pages and calls (``tiers``) and its
    ``first_tier``, ``read_order``, ``writes``, ``promotions`` and ``write_behind`` sections;
    empty without storage."""
    planner: dict[str, Any] = field(default_factory=dict)
    """The cache's planner (:meth:`Planner.stats <hicache_storage.planner.Planner.stats>`): pages
    per decision by the rule that made it (``fetch_pages``, under ``adaptive``; ``write_pages``,
    written or shed), its write gate's counts (``gate``) and the measured rates (``rates``)."""

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens reused from any tier."""
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


@dataclass
class Spread:
    """The median and the range of one figure over a configuration's repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """Return the spread of ``values`` (at least one)."""
        return cls(float(np.median(values)), float(min(values)), float(max(values)))


@dataclass
class RunSummary:
    """One configuration over its repeats: median and range of TTFT, by round, throughput."""

    name: str
    repeats: int
    ttft_mean_s: Spread
    ttft_p90_s: Spread
    total_tokens_per_s: Spread
    ttft_by_round_s: list[Spread | None]
    ttft_over_bound: Spread | None
    parts_mean_s: dict[str, float]


@dataclass
class BenchResult:
    """A benchmark's configuration, model, machine and every configuration's results.

    ``runs`` holds every repeat (``RunResult.repeat``); :meth:`run` gives the first repeat of a
    configuration and ``summary`` each configuration's median and spread over its repeats.
    """

    config: BenchConfig
    model: dict[str, Any]
    environment: dict[str, Any]
    device_pool_bytes: int
    host_pool_bytes: int
    runs: list[RunResult]
    rates: MachineRates | None = None
    summary: list[RunSummary] = field(default_factory=list)

    def run(self, name: str) -> RunResult:
        """Return the (first) result of configuration ``name`` (one of :data:`RUNS`)."""
        for result in self.runs:
            if result.name == name:
                return result
        raise KeyError(name)

    def summary_of(self, name: str) -> RunSummary:
        """Return configuration ``name``'s summary over its repeats."""
        for summary in self.summary:
            if summary.name == name:
                return summary
        raise KeyError(name)

    def to_json(self, *, indent: int = 0) -> bytes:
        """Return the result as JSON (``indent`` spaces per level), backend secrets masked."""
        options = self.config.backend_config
        config = dataclasses.replace(
            self.config, backend_config=None if options is None else redact_options(options)
        )
        data = msgspec.json.encode(dataclasses.replace(self, config=config))
        return msgspec.json.format(data, indent=indent) if indent else data

    @classmethod
    def from_json(cls, data: bytes | str) -> BenchResult:
        """Read a result written by :meth:`to_json`."""
        return msgspec.json.decode(data, type=cls)


def run_bench(
    config: BenchConfig,
    *,
    progress: Progress | None = None,
    runs: Sequence[str] | None = None,
) -> BenchResult:
    """Serve ``config``'s workload over the four cache configurations and measure each.

    Parameters
    ----------
    config
        The run (see :class:`BenchConfig`).
    progress
        Called after every finished request (and once at the start of each configuration).
    runs
        Names of the configurations to run (default: all of :data:`RUNS`); ``no-cache`` always
        runs, as the others are checked against its tokens.

    Raises
    ------
    ConfigError
        If a request of the workload could not fit in the device pool, or the model and its
        pools cannot fit the machine (checked before anything is built).
    """
    wanted = [name for name, _ in RUNS] if runs is None else list(runs)
    (result,) = run_benches([(config, wanted)], progress=progress)
    return result


BenchJob = tuple["BenchConfig", Sequence[str]]
"""A configuration and the names of the runs (besides ``no-cache``) to serve over it."""

_SHARED = ("model", "device", "dtype", "workload", "repeat", "warmup", "backend", "backend_config")
"""What the jobs of one :func:`run_benches` call share: one model, workload and store."""


def run_benches(
    jobs: Sequence[BenchJob],
    *,
    progress: Progress | None = None,
    done: Callable[[int, BenchResult], None] | None = None,
) -> list[BenchResult]:
    """Serve several configurations of one model and workload, building the model once.

    Each job is a configuration (host pool, policies, faults) and the runs to serve over it;
    ``no-cache`` runs once, with the first job, and every job's result holds it as its
    reference (the no-cache run does not depend on a job's host pool, policies or store).
    ``done`` sees each job's result as its runs end. Jobs must share the fields of
    ``_SHARED`` and the device pool.

    Raises
    ------
    ConfigError
        As :func:`run_bench`, or if the jobs differ in model or workload.
    """
    if not jobs:
        return []
    known = [name for name, _ in (*RUNS, *EXTRA_RUNS)]
    first = jobs[0][0]
    for config, names in jobs:
        unknown = set(names) - set(known)
        if unknown:
            raise ConfigError(f"unknown configurations {sorted(unknown)}; known: {known}")
        differ = [name for name in _SHARED if getattr(config, name) != getattr(first, name)]
        if config.engine.device_tokens != first.engine.device_tokens:
            differ.append("engine.device_tokens")
        if config.cache.page_size != first.cache.page_size:
            differ.append("page_size")
        if differ:
            raise ConfigError(f"jobs of one model run must share {', '.join(differ)}")
    shape = first.model_config()
    device = torch.device(first.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {first.device!r} asked for, but torch sees no CUDA device")
    largest = max((config for config, _ in jobs), key=lambda config: config.engine.host_tokens)
    check_memory(
        shape,
        device,
        device_tokens=first.engine.device_tokens,
        host_tokens=largest.engine.host_tokens,
    )
    turns = first.workload.turns(shape.vocab_size)
    for config, _ in jobs:
        _check_fits(config, turns)
    model = LlamaModel(shape, device)
    _warm_model(model, first)
    rates = _measure_rates(first, shape, device)
    token_bytes = shape.kv_bytes_per_token
    reference: dict[tuple[int, int], list[int]] | None = None
    shared: list[RunResult] = []
    results: list[BenchResult] = []
    for index, (config, names) in enumerate(jobs):
        wanted = {"no-cache", *names} if index == 0 else set(names)
        served: list[RunResult] = []
        for repeat in range(config.repeat):
            for name, description in (*RUNS, *EXTRA_RUNS):
                if name not in wanted:
                    continue
                warm = config.warmup and repeat == 0
                result = _serve(config, name, description, model, turns, progress, warm=warm)
                result.repeat = repeat
                outputs = {(r.client, r.round): r.output for r in result.records}
                if reference is None:
                    reference = outputs
                result.identical = outputs == reference
                result.matching_outputs = sum(
                    reference.get(key) == out for key, out in outputs.items()
                )
                result.matching_first_tokens = sum(
                    key in reference and reference[key][:1] == out[:1]
                    for key, out in outputs.items()
                )
                if name == "no-cache" and rates.compute_s_per_token is None:
                    rates.compute_s_per_token = result.costs.get("compute_s_per_token")
                _bound(result, rates, token_bytes)
                served.append(result)
        if index == 0:
            shared = [run for run in served if run.name == "no-cache"]
        else:
            served = [*shared, *served]
        engine = config.engine
        bench = BenchResult(
            config=config,
            model=_describe_model(config.model, shape),
            environment=_environment(device),
            device_pool_bytes=engine.device_tokens * token_bytes,
            host_pool_bytes=engine.host_tokens * token_bytes,
            runs=served,
            rates=rates,
            summary=_summaries(served),
        )
        results.append(bench)
        if done is not None:
            done(index, bench)
    return results


def _warm_model(model: LlamaModel, config: BenchConfig) -> None:
    """Run the largest forward the runs will make before any clock starts.

    Compiles kernels and grows the allocator to its working size, so that the first
    configuration does not pay for either.
    """
    tokens = max(min(config.engine.chunk_tokens, config.engine.device_tokens) - 1, 1)
    model.generate_no_cache([1] * tokens, 2)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


_RATE_PAGES = 16
"""Pages each machine rate is measured over."""


def _measure_rates(config: BenchConfig, shape: ModelConfig, device: torch.device) -> MachineRates:
    """Measure the raw parallel read rate of the model's pages and the host-to-device rate."""
    page_bytes = config.cache.page_size * shape.kv_bytes_per_token
    total = page_bytes * _RATE_PAGES
    source = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source.random_(0, 256)
    target = torch.empty(total, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        target.copy_(source, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    del target
    return MachineRates(_raw_read_gbps(config, source, page_bytes), total / best / 1e9)


def _raw_read_gbps(config: BenchConfig, source: torch.Tensor, page_bytes: int) -> float | None:
    """Read ``_RATE_PAGES`` pages through the backend's raw baseline; best of three, GB/s."""
    from hicache_storage.config import Deployment, convert
    from hicache_storage.registry import get_spec

    spec = get_spec(config.backend)
    baseline_type = spec.load_baseline()
    if baseline_type is None:
        return None
    options = convert(
        dict(config.backend_config or {}), spec.load_config_type(), f"{config.backend} options"
    )
    baseline = baseline_type(options, Deployment())
    names = [f"hicache-engine-rate-{i}" for i in range(_RATE_PAGES)]
    data = source.numpy().data
    values = [data[i * page_bytes : (i + 1) * page_bytes] for i in range(_RATE_PAGES)]
    outs = [memoryview(bytearray(page_bytes)) for _ in range(_RATE_PAGES)]
    try:
        baseline.batch_write(names, values)
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            baseline.batch_read(names, outs)
            best = min(best, time.perf_counter() - began)
    finally:
        baseline.close()
    return page_bytes * _RATE_PAGES / best / 1e9


def _bound(result: RunResult, rates: MachineRates, token_bytes: int) -> None:
    """Fill in each record's bound and the run's mean bound and TTFT over bound."""
    bounds = []
    for record in result.records:
        record.bound_s = rates.bound_s(record, token_bytes)
        if record.bound_s is not None:
            bounds.append(record.bound_s)
    if bounds and len(bounds) == len(result.records):
        result.bound_mean_s = float(np.mean(bounds))
        if result.bound_mean_s > 0:
            result.ttft_over_bound = result.ttft_mean_s / result.bound_mean_s


def _summaries(results: Sequence[RunResult]) -> list[RunSummary]:
    """Return each configuration's median and range over its repeats, in run order."""
    names = list(dict.fromkeys(result.name for result in results))
    out = []
    for name in names:
        runs = [r for r in results if r.name == name]
        rounds = max(len(r.ttft_by_round_s) for r in runs)
        by_round: list[Spread | None] = []
        for i in range(rounds):
            values = [t for r in runs if i < len(r.ttft_by_round_s) and (t := r.ttft_by_round_s[i])]
            by_round.append(Spread.of(values) if values else None)
        ratios = [r.ttft_over_bound for r in runs if r.ttft_over_bound is not None]
        out.append(
            RunSummary(
                name=name,
                repeats=len(runs),
                ttft_mean_s=Spread.of([r.ttft_mean_s for r in runs]),
                ttft_p90_s=Spread.of([r.ttft_p90_s for r in runs]),
                total_tokens_per_s=Spread.of([r.total_tokens_per_s for r in runs]),
                ttft_by_round_s=by_round,
                ttft_over_bound=Spread.of(ratios) if len(ratios) == len(runs) else None,
                parts_mean_s={
                    part: float(np.median([r.parts_mean_s.get(part, 0.0) for r in runs]))
                    for part in PARTS
                },
            )
        )
    return out


def _check_fits(config: BenchConfig, turns: Sequence[Turn]) -> None:
    """Refuse a workload whose longest request exceeds the device pool, before any work."""
    history: dict[int, int] = {}
    page = config.cache.page_size
    pool = config.engine.device_tokens
    for turn in turns:
        prior = history.get(turn.client, 0) if config.workload.kind == "multiturn" else 0
        total = prior + len(turn.new_tokens) + turn.max_new_tokens - 1
        need = -(-total // page) * page
        if need > pool:
            raise ConfigError(
                f"round {turn.round} of client {turn.client} needs {need} device slots but the "
                f"device pool has {pool}; raise engine.device_tokens or shorten the "
                f"workload"
            )
        history[turn.client] = prior + len(turn.new_tokens) + turn.max_new_tokens


def _build_cache(config: BenchConfig, name: str, backend: StorageBackend | None) -> TierCache:
    """Return a fresh cache of configuration ``name`` over ``config.cache``.

    ``no-cache`` has no prefix cache; ``L1+L2`` and ``L1+L2+L3`` have a host pool.
    """
    engine = config.engine
    return build_cache(
        config.model_config(),
        dataclasses.replace(config.cache, prefix_cache=name != "no-cache"),
        device_tokens=engine.device_tokens,
        host_tokens=engine.host_tokens if name.startswith("L1+L2") else None,
        backend=backend,
        device=config.device,
        host_layout=engine.host_layout.value,
        shared_host=backend is not None and backend.capabilities.shared_host_pool,
    )


def _serve(
    config: BenchConfig,
    name: str,
    description: str,
    model: LlamaModel,
    turns: Sequence[Turn],
    progress: Progress | None,
    *,
    warm: bool = False,
) -> RunResult:
    """Serve ``turns`` over configuration ``name`` on fresh pools (and a cleared backend).

    ``warm`` first serves a few clients' turns untimed (:func:`_warm_serve`).
    """
    if warm:
        _warm_serve(config, name, model, turns)
    backend = None
    cleared: bool | None = None
    if _stored(name):
        backend = _open_backend(config, name)
        cleared = _clear(backend)
    try:
        with _engine(config, name, model, backend) as engine:
            cache = engine.cache
            assert engine.scheduler is not None and cache is not None
            if progress is not None:
                progress(name, 0, len(turns))
            steps: list[StepRecord] = []
            engine.scheduler.on_step = steps.append
            start, records, end = _drive(engine, config, turns, name, progress)
            forwards = engine.scheduler.forwards
            costs = cache.costs.snapshot()
        # Closed: queued backups are written, so the storage stats are final.
        if torch.device(config.device).type == "cuda":
            torch.cuda.synchronize(config.device)
        storage = {} if backend is None else _storage_stats(backend.stats())
    finally:
        if backend is not None:
            backend.close()
    result = _summarise(name, description, records, end - start, forwards, cache, cleared)
    result.costs = costs
    result.storage_stats = storage
    result.steps = [dataclasses.replace(step, started=step.started - start) for step in steps]
    return result


def _warm_serve(config: BenchConfig, name: str, model: LlamaModel, turns: Sequence[Turn]) -> None:
    """Serve the first clients' turns over a throwaway cache of configuration ``name``, untimed.

    The model's warm-up runs one forward; a run makes forwards of every shape its workload
    brings (decode batches over contexts as long as the longest, prefills over cached
    prefixes, loads of fetched pages), and on the H200 the first run of a configuration paid
    for the shapes it met first: 0.5-1.9 s forwards of a few tokens, in the first repeat only
    (``docs/performance.md``). As many clients as run at once (at most all of them) go through
    every round here, on pools of the run's sizes, so those costs land before the clock.
    With storage, the warm-up has a backend object of its own (the run's counts its own
    calls only) and starts on an emptied store, as the run does (which empties it again); a
    store that cannot be emptied is left alone and the warm-up goes without it.
    """
    workload = config.workload
    clients = min(workload.concurrency or workload.clients, workload.clients)
    backend = _open_backend(config, name) if _stored(name) else None
    try:
        if backend is not None and not _clear(backend):
            backend.close()
            backend = None
        with _engine(config, name, model, backend) as engine:
            _drive(engine, config, [t for t in turns if t.client < clients], name, None)
        del engine
    finally:
        if backend is not None:
            backend.close()
        gc.collect()  # the throwaway pools go before the run allocates its own


def _engine(
    config: BenchConfig, name: str, model: LlamaModel, backend: StorageBackend | None
) -> Engine:
    """Return an engine over a fresh cache of configuration ``name``, its copies compiled."""
    cache = _build_cache(config, name, backend)
    _warm_transfer(cache)
    return Engine(
        model,
        cache,
        chunk_tokens=config.engine.chunk_tokens,
        max_running=config.engine.max_running,
        managed_gc=config.engine.managed_gc,
    )


def _stored(name: str) -> bool:
    """Return whether configuration ``name`` has a storage tier."""
    return name.startswith("L1+L2+L3")


def _open_backend(config: BenchConfig, name: str) -> StorageBackend:
    """Open run ``name``'s storage backend: the default layers, and the fault layer's delay."""
    faults = config.faults
    if config.read_delay_s:
        base = faults or FaultConfig()
        delayed = {"batch_get_v1": FaultRule(delay_s=config.read_delay_s)}
        faults = msgspec.structs.replace(base, ops={**base.ops, **delayed})
    layers = LayerConfig(faults=faults, verify=name != "L1+L2+L3-unverified")
    return create_backend(config.backend, config.backend_config, layers=layers)


def _clear(backend: StorageBackend) -> bool:
    """Empty the store; False if the backend cannot."""
    try:
        backend.clear()
    except UnsupportedOperationError:
        return False
    return True


def _warm_transfer(cache: TierCache) -> None:
    """Compile the GPU copy kernels for the copies the run will make, before the clock starts.

    Triton specialises the kernel on the token count's size class and on integer arguments
    (the first layer, counts divisible by 16), so copies of a new kind compile on first use;
    unwarmed, those compiles land in the first configuration with a host pool as seconds of
    load time. This copies every page count up to ``_WARM_COUNTS`` pages (then powers of two),
    all layers at once (backups) and layer by layer (loads). The slots are free: contents
    are garbage and nothing reads them.
    """
    transfer = cache.transfer
    if transfer is None or cache.device_pool.device.type != "cuda":
        return
    page = cache.config.page_size
    limit = min(cache.device_pool.size, transfer.host.size) // page
    counts = list(range(1, min(limit, _WARM_COUNTS) + 1))
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    for count in counts:
        slots = torch.arange(count * page, dtype=torch.int64, device=cache.device_pool.device)
        transfer.backup(slots, slots)
        for layer in range(cache.device_pool.layer_num):
            transfer.load(slots, slots, layer=layer)
    torch.cuda.synchronize(cache.device_pool.device)


def _drive(
    engine: Engine,
    config: BenchConfig,
    turns: Sequence[Turn],
    name: str,
    progress: Progress | None,
) -> tuple[float, list[RequestRecord], float]:
    """Submit turns in order once due, their client free and a slot free; step until all finish.

    A turn's arrival stamp is the latest of its scheduled time, its client's previous finish and
    (with ``concurrency``) the finish that freed its slot: when its client would have sent it.
    """
    scheduler = engine.scheduler
    assert scheduler is not None
    limit = config.workload.concurrency or len(turns)
    multiturn = config.workload.kind == "multiturn"
    pending = list(turns)
    conversations: dict[int, Conversation] = {}
    busy: set[int] = set()
    freed_at: dict[int, float] = {}
    slot_freed_at = 0.0
    records: list[RequestRecord] = []
    clock = scheduler.clock
    start = clock()
    end = start
    while len(records) < len(turns):
        now = clock()
        blocked: set[int] = set(busy)  # a client's turns go in order: skip it after its first
        for turn in list(pending):
            if len(busy) >= limit:
                break
            if turn.client in blocked or start + turn.arrival_s > now:
                blocked.add(turn.client)
                continue
            pending.remove(turn)
            conversation = conversations.setdefault(turn.client, Conversation())
            prompt = conversation.prompt(turn) if multiturn else list(turn.new_tokens)
            arrival = max(start + turn.arrival_s, freed_at.get(turn.client, start), slot_freed_at)
            scheduler.submit(Request(prompt, turn.max_new_tokens, tag=turn), arrival=arrival)
            busy.add(turn.client)
            blocked.add(turn.client)
        finished = scheduler.step()
        for request in finished:
            done = request.tag
            assert isinstance(done, Turn)
            assert request.first_token_at is not None and request.finished_at is not None
            conversations[done.client].answer(done, request.output)
            if len(busy) >= limit:
                slot_freed_at = request.finished_at
            busy.discard(done.client)
            freed_at[done.client] = request.finished_at
            end = max(end, request.finished_at)
            parts = request.timings or {}
            records.append(
                RequestRecord(
                    client=done.client,
                    round=done.round,
                    arrival_s=request.arrival - start,
                    ttft_s=request.first_token_at - request.arrival,
                    finished_s=request.finished_at - start,
                    prompt_tokens=len(request.prompt),
                    device_hit=request.device_hit,
                    host_hit=request.host_hit,
                    storage_hit=request.storage_hit,
                    output=list(request.output),
                    storage_found=request.storage_found,
                    **{f"{part}_s": parts.get(part, 0.0) for part in PARTS},
                )
            )
            if progress is not None:
                progress(name, len(records), len(turns))
        if not finished and not scheduler.running:
            _idle(scheduler.idle, pending, busy, start, clock())
    return start, records, end


def _idle(idle: bool, pending: list[Turn], busy: set[int], start: float, now: float) -> None:
    """Sleep until the next due turn when nothing runs (briefly while prefetches are waited)."""
    if not idle:
        time.sleep(0.001)
        return
    due = [start + turn.arrival_s for turn in pending if turn.client not in busy]
    if due:
        time.sleep(min(max(min(due) - now, 0.0), 0.05))


_TIER_SECTIONS = ("health", "degraded", "capacity")
"""What a chain run keeps of each tier's own stats besides its calls: whether its layers shed
or absorbed calls, and how full it was."""


def _storage_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """Keep what a run records of the backend's stats (see :attr:`RunResult.storage_stats`)."""
    out: dict[str, Any] = {"ops": stats.get("metrics", {}).get("ops", {})}
    if stats.get("degraded", {}).get("total"):
        out["degraded"] = stats["degraded"]
    if stats.get("integrity_failures"):
        out["integrity_failures"] = stats["integrity_failures"]
    if "verify" in stats:
        out["verify"] = stats["verify"]
    if isinstance(stats.get("tiers"), list):  # a chain: each tier's pages and calls
        out["tiers"] = [
            {
                **{k: v for k, v in tier.items() if k != "stats"},
                "ops": tier.get("stats", {}).get("metrics", {}).get("ops", {}),
                **{k: tier["stats"][k] for k in _TIER_SECTIONS if k in tier.get("stats", {})},
            }
            for tier in stats["tiers"]
        ]
        for section in ("first_tier", "read_order", "writes", "promotions", "write_behind"):
            if section in stats:
                out[section] = stats[section]
    return out


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _summarise(
    name: str,
    description: str,
    records: list[RequestRecord],
    wall_s: float,
    forwards: int,
    cache: TierCache,
    cleared: bool | None,
) -> RunResult:
    stats = cache.stats
    ttfts = [r.ttft_s for r in records]
    by_round: dict[int, list[float]] = {}
    for record in records:
        by_round.setdefault(record.round, []).append(record.ttft_s)
    rounds = max(by_round, default=-1) + 1
    prompt = sum(r.prompt_tokens for r in records)
    generated = sum(len(r.output) for r in records)
    hits = sum(r.device_hit + r.host_hit + r.storage_hit for r in records)
    wall = max(wall_s, 1e-9)
    return RunResult(
        name=name,
        description=description,
        identical=True,
        matching_outputs=len(records),
        matching_first_tokens=len(records),
        requests=len(records),
        prompt_tokens=prompt,
        generated_tokens=generated,
        computed_tokens=prompt - hits,
        device_hit_tokens=sum(r.device_hit for r in records),
        host_hit_tokens=sum(r.host_hit for r in records),
        storage_hit_tokens=sum(r.storage_hit for r in records),
        ttft_mean_s=float(np.mean(ttfts)) if ttfts else 0.0,
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p90_s=_percentile(ttfts, 90),
        ttft_p99_s=_percentile(ttfts, 99),
        ttft_by_round_s=[
            float(np.mean(by_round[i])) if i in by_round else None for i in range(rounds)
        ],
        wall_s=wall_s,
        generated_tokens_per_s=generated / wall,
        total_tokens_per_s=(prompt + generated) / wall,
        storage_bytes_read=stats.storage_bytes_read,
        storage_bytes_written=stats.storage_bytes_written,
        loads=stats.loads,
        load_s=stats.load_s,
        exposed_load_s=stats.exposed_load_s,
        exposed_per_layer_s=stats.exposed_load_s / stats.layer_loads if stats.layer_loads else None,
        exposed_fraction=stats.exposed_load_s / stats.load_s if stats.load_s > 0 else None,
        forwards=forwards,
        storage_cleared=cleared,
        cache=dataclasses.asdict(stats),
        planner=cache.planner.stats(),
        records=records,
        parts_mean_s={
            part: float(np.mean([getattr(r, f"{part}_s") for r in records])) if records else 0.0
            for part in PARTS
        },
    )


def _describe_model(name: str, shape: ModelConfig) -> dict[str, Any]:
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    fields["dtype"] = str(shape.dtype).removeprefix("torch.")
    return {"name": name, **fields, "kv_bytes_per_token": shape.kv_bytes_per_token}


def _environment(device: torch.device) -> dict[str, Any]:
    try:
        version = importlib.metadata.version("hicache-storage")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hicache_storage": version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = str(torch.version.cuda)
    return info


def plot_ttft_by_round(result: BenchResult, path: str | Path, *, log_y: bool = False) -> None:
    """Write a PNG of mean TTFT per round (median, range over repeats) and where time went.

    The left panel draws each configuration's mean TTFT by round, as the median over the
    repeats with their range as error bars; the right one stacks each configuration's mean
    time to first token by part (:data:`PARTS`) beside its mean per-request bound.

    Raises
    ------
    MissingDependencyError
        If matplotlib is not installed (``pip install 'hicache-storage[engine-bench]'``).
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise MissingDependencyError(
            "the TTFT plot needs matplotlib: pip install 'hicache-storage[engine-bench]'"
        ) from exc
    summaries = result.summary or _summaries(result.runs)
    figure = Figure(figsize=(12, 4.4), layout="constrained")
    rounds, parts = figure.subplots(1, 2, width_ratios=(3, 2))
    for summary in summaries:
        points = [(i, t) for i, t in enumerate(summary.ttft_by_round_s) if t is not None]
        medians = [t.median * 1e3 for _, t in points]
        below = [(t.median - t.low) * 1e3 for _, t in points]
        above = [(t.high - t.median) * 1e3 for _, t in points]
        rounds.errorbar(
            [i for i, _ in points],
            medians,
            yerr=[below, above],
            marker="o",
            capsize=3,
            label=summary.name,
        )
    config = result.config
    workload = config.workload.kind
    rounds.set_xlabel("round" if workload == "multiturn" else "query of each document")
    rounds.xaxis.set_major_locator(MaxNLocator(integer=True))
    rounds.set_ylabel("mean TTFT (ms)")
    if log_y:
        rounds.set_yscale("log")
    repeats = max((summary.repeats for summary in summaries), default=1)
    rounds.set_title(
        f"{workload}, {config.model} on {config.device}, L3 {config.backend}"
        + (f" (median of {repeats}, range)" if repeats > 1 else "")
    )
    rounds.grid(True, alpha=0.3)
    rounds.legend()
    names = [summary.name for summary in summaries]
    left = np.zeros(len(names))
    for part in PARTS:
        widths = np.array([summary.parts_mean_s.get(part, 0.0) * 1e3 for summary in summaries])
        parts.barh(names, widths, left=left, label=part.replace("_", " "))
        left += widths
    bounds = [result.run(name).bound_mean_s for name in names]
    marks = [(i, b * 1e3) for i, b in enumerate(bounds) if b is not None]
    if marks:
        parts.scatter(
            [ms for _, ms in marks],
            [i for i, _ in marks],
            marker="|",
            s=400,
            c="black",
            label="bound",
            zorder=3,
        )
    parts.invert_yaxis()
    parts.set_xlabel("mean time to first token (ms)")
    parts.set_title("where each request's time went")
    parts.legend(fontsize="small")
    parts.grid(True, axis="x", alpha=0.3)
    figure.savefig(str(path), dpi=120)
