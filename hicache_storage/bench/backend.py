"""Measure a backend against its raw baseline: the library side of ``hicache bench``.

:func:`run_bench` builds the backend as users get it (:func:`~hicache_storage.create_backend`
with the default layers, less the verify layer: the bench checks every page's bytes itself, and
what verification costs is ``scripts/bench_verify.py``'s to measure) and the backend's raw baseline
(plain writes and reads of the same bytes to the same medium), then times ``batch_set``,
``batch_exists`` and ``batch_get`` against the baseline's ``batch_write`` and ``batch_read``,
interleaved per repeat so both see the same state of the store. Every value read back is compared
with what was written: a benchmark of wrong answers is worthless, so wrong bytes or misses raise
:class:`BenchError`.

With ``mode="v1"`` it times the zero-copy calls instead: ``batch_set_v1`` / ``batch_get_v1`` on
the pages of a registered MHA host pool against the baseline's ``batch_write_v1`` /
``batch_read_v1`` on the same pages (a baseline offers that mode by also defining
``register_host_pool``), every loaded page checked against the bytes written.

It also times :func:`~hicache_storage.keys.page_hashes` against one unchained ``hashlib.sha256``
call per page over the same bytes.

The report is made of msgspec Structs, so ``msgspec.json.encode(report)`` is its JSON form.
Throughput is in decimal units: GB/s is 10**9 bytes per second, MB/s is 10**6.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from hicache_storage.backend import StorageBackend
from hicache_storage.config import Deployment, LayerConfig, convert, read_source
from hicache_storage.errors import ConfigError, HiCacheError, UnsupportedOperationError
from hicache_storage.factory import create_backend
from hicache_storage.keys import page_hashes
from hicache_storage.kit.baseline import V1_CALLS
from hicache_storage.kit.options import bytes_of
from hicache_storage.registry import get_spec

from .report import format_size

__all__ = [
    "BenchError",
    "BenchReport",
    "HashStats",
    "OpStats",
    "PageSizeStats",
    "parse_size",
    "parse_sizes",
    "run_bench",
]

_LAYERS = LayerConfig(verify=False)
"""The default layers without verify: a page read back wrong is the bench's to report."""

Progress = Callable[[str], None]
T = TypeVar("T")

_STRIDE = 64
"""Bytes between the starts of consecutive values sliced from the shared random block."""


class BenchError(HiCacheError, RuntimeError):
    """The benchmark cannot give a meaningful answer (wrong bytes, misses, failed writes)."""


# -- report -------------------------------------------------------------------------------------


class OpStats(msgspec.Struct, frozen=True, kw_only=True):
    """Timings of one operation over every repeat.

    Attributes
    ----------
    op
        ``set``, ``exists``, ``get`` (the backend) or ``raw_write``, ``raw_read`` (the baseline).
    calls
        Batch calls timed.
    keys
        Keys handled by those calls.
    nbytes
        Value bytes moved (0 for ``exists``, which moves none).
    seconds
        Total time inside the timed calls.
    gb_per_s
        ``nbytes / seconds / 1e9``, or ``None`` for ``exists``.
    keys_per_s
        ``keys / seconds``.
    p50_ms, p99_ms
        Median and 99th percentile latency of one batch call, in milliseconds.
    """

    op: str
    calls: int
    keys: int
    nbytes: int
    seconds: float
    gb_per_s: float | None
    keys_per_s: float
    p50_ms: float
    p99_ms: float


class PageSizeStats(msgspec.Struct, frozen=True, kw_only=True):
    """Results for one value size.

    Attributes
    ----------
    page_size
        Bytes per value.
    set, exists, get
        The backend's batch calls, through the default layers.
    raw_write, raw_read
        The baseline's calls on the same bytes, or ``None`` when the backend has no baseline.
    set_ratio, get_ratio
        Backend GB/s over baseline GB/s (1.0 means as fast as raw), or ``None``.
    verified
        Values read back and compared byte for byte (backend and baseline).
    cleanup
        How the backend's objects were removed: ``deleted``, ``cleared`` or ``left``.
    """

    page_size: int
    set: OpStats
    exists: OpStats
    get: OpStats
    raw_write: OpStats | None
    raw_read: OpStats | None
    set_ratio: float | None
    get_ratio: float | None
    verified: int
    cleanup: str


class HashStats(msgspec.Struct, frozen=True, kw_only=True):
    """Throughput of chained page hashing beside unchained raw sha256 over the same bytes.

    Attributes
    ----------
    tokens
        Tokens hashed per repeat (an int64 array, converted by ``page_hashes`` as in serving).
    page_tokens
        Tokens per page.
    pages
        Pages per repeat.
    nbytes
        Token bytes hashed per repeat (4 per token).
    repeat
        Repeats timed.
    seconds, raw_seconds
        Total time of ``page_hashes`` and of the raw loop.
    pages_per_s, mb_per_s
        ``page_hashes`` throughput.
    raw_pages_per_s, raw_mb_per_s
        Raw ``hashlib.sha256(page).digest()`` throughput.
    ratio
        ``pages_per_s / raw_pages_per_s``.
    """

    tokens: int
    page_tokens: int
    pages: int
    nbytes: int
    repeat: int
    seconds: float
    raw_seconds: float
    pages_per_s: float
    mb_per_s: float
    raw_pages_per_s: float
    raw_mb_per_s: float
    ratio: float


class BenchReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``hicache bench`` measured.

    Attributes
    ----------
    backend
        The backend name.
    version
        hicache-storage version.
    batch_size, batches, repeat
        Keys per batch call, batch calls per repeat and repeats, for every page size.
    results
        One entry per page size, in the order asked.
    hashing
        Page-hash throughput.
    set_ratio, get_ratio
        Geometric mean over page sizes of the per-size ratios, or ``None`` without a baseline.
    mode
        ``copy`` (``batch_set``/``batch_get``) or ``v1:<layout>`` (the zero-copy calls).
    """

    backend: str
    version: str
    batch_size: int
    batches: int
    repeat: int
    results: list[PageSizeStats]
    hashing: HashStats
    set_ratio: float | None
    get_ratio: float | None
    mode: str = "copy"


# -- sizes --------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Parse one size such as ``"4MiB"``, ``"64KiB"``, ``"1.5MiB"``, ``"1MB"`` or ``"4096"``.

    IEC suffixes (``KiB``, ``MiB``, ...) and bare letters (``K``, ``M``, ...) are powers of
    1024; SI suffixes (``KB``, ``MB``, ...) are powers of 1000
    (:func:`~hicache_storage.kit.options.bytes_of` with ``units="si"``). Case is ignored.

    Raises
    ------
    ConfigError
        If the text is not a size, or the size is not a positive whole number of bytes.
    """
    number = bytes_of(text, units="si")
    if number is None:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 4096, 64KiB, 1MiB or 1.5MB")
    if number < 1 or not number.is_integer():
        raise ConfigError(f"size {text!r} is not a positive whole number of bytes")
    return int(number)


def parse_sizes(text: str) -> list[int]:
    """Parse a comma-separated list of sizes (``"1MiB,4MiB,64KiB"``), in order.

    Raises
    ------
    ConfigError
        If the list is empty or any item is not a size.
    """
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"no sizes in {text!r}; write e.g. 1MiB,4MiB")
    return [parse_size(item) for item in items]


def _available_memory() -> int | None:
    """Return the bytes of memory free now, or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(persistent: bool, page_size: int, batch_size: int, values: int) -> None:
    """Refuse a run that cannot fit in memory before allocating anything.

    The run holds a random block and two batches of output buffers per page size; a backend
    that is not persistent (in-process) also holds every value it and its baseline stored.

    Raises
    ------
    ConfigError
        If the estimate exceeds 80 % of the memory free now.
    """
    free = _available_memory()
    if free is None:
        return
    need = page_size * (1 + 2 * batch_size + (0 if persistent else 2 * values))
    if need > 0.8 * free:
        raise ConfigError(
            f"a run with {format_size(page_size)} pages needs about {need / 2**30:.1f} GiB of "
            f"memory and {free / 2**30:.1f} GiB is free; use a smaller --page-size or fewer "
            f"--batch-size/--batches/--repeat"
        )


# -- measurement --------------------------------------------------------------------------------


class _Timer:
    """Collect per-call latencies of one operation."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.samples_ns: list[int] = []
        self.keys = 0
        self.nbytes = 0

    def measure(self, keys: int, nbytes: int, call: Callable[..., T], *args: Any) -> T:
        start = time.perf_counter_ns()
        result = call(*args)
        self.samples_ns.append(time.perf_counter_ns() - start)
        self.keys += keys
        self.nbytes += nbytes
        return result

    def stats(self, *, moves_bytes: bool = True) -> OpStats:
        seconds = max(sum(self.samples_ns), 1) / 1e9
        p50, p99 = np.percentile(np.asarray(self.samples_ns, dtype=np.float64) / 1e6, [50, 99])
        return OpStats(
            op=self.op,
            calls=len(self.samples_ns),
            keys=self.keys,
            nbytes=self.nbytes,
            seconds=seconds,
            gb_per_s=self.nbytes / seconds / 1e9 if moves_bytes else None,
            keys_per_s=self.keys / seconds,
            p50_ms=float(p50),
            p99_ms=float(p99),
        )


def _ratio(backend: OpStats, raw: OpStats | None) -> float | None:
    if raw is None or backend.gb_per_s is None or not raw.gb_per_s:
        return None
    return backend.gb_per_s / raw.gb_per_s


def _geomean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and v > 0]
    if not present or len(present) != len(values):
        return None
    return math.exp(sum(math.log(v) for v in present) / len(present))


def _same(out: bytearray, expected: memoryview) -> bool:
    return bool(
        np.array_equal(np.frombuffer(out, dtype=np.uint8), np.frombuffer(expected, dtype=np.uint8))
    )


def _verify(
    who: str,
    keys: Sequence[str],
    hits: Sequence[bool],
    outs: Sequence[bytearray],
    values: Sequence[memoryview],
) -> int:
    missed = [key for key, hit in zip(keys, hits, strict=True) if not hit]
    if missed:
        raise BenchError(
            f"{who} missed {len(missed)} of {len(keys)} keys it had just stored "
            f"(first: {missed[0]!r}); the measurements would be meaningless"
        )
    wrong = [
        key for key, out, value in zip(keys, outs, values, strict=True) if not _same(out, value)
    ]
    if wrong:
        raise BenchError(
            f"{who} returned wrong bytes for {len(wrong)} of {len(keys)} keys "
            f"(first: {wrong[0]!r}); a benchmark of wrong answers is worthless"
        )
    return len(keys)


def _zero(outs: Sequence[bytearray]) -> None:
    for out in outs:
        np.frombuffer(out, dtype=np.uint8).fill(0)


def _cleanup(backend: StorageBackend, keys: Sequence[str]) -> str:
    """Remove what the run wrote: only its own keys when it can, else ``clear()``."""
    if backend.capabilities.delete:
        for key in keys:
            backend.delete(key)
        return "deleted"
    try:
        backend.clear()
    except UnsupportedOperationError:
        return "left"
    return "cleared"


class _Round:
    """The timed calls of one page size, one batch at a time, against a backend and its baseline.

    Every method handles one batch and checks its answer outside the timed call.
    """

    def __init__(
        self,
        name: str,
        backend: StorageBackend,
        baseline: Any,
        page_size: int,
        batch_size: int,
    ) -> None:
        self.name = name
        self.backend = backend
        self.baseline = baseline
        self.page_size = page_size
        self.nbytes = batch_size * page_size
        self.outs = [bytearray(page_size) for _ in range(batch_size)]
        self.views = [memoryview(out) for out in self.outs]
        self.timers = {op: _Timer(op) for op in ("set", "exists", "get", "raw_write", "raw_read")}
        self.written: list[str] = []
        self.verified = 0

    def backend_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> None:
        stored = self.timers["set"].measure(
            len(keys), self.nbytes, self.backend.batch_set, keys, values
        )
        self.written.extend(keys)
        if not all(stored):
            raise BenchError(
                f"backend {self.name!r} failed to store {stored.count(False)} of {len(keys)} "
                f"values of {format_size(self.page_size)}; see its log"
            )

    def raw_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        if self.baseline is not None:
            write = self.baseline.batch_write
            self.timers["raw_write"].measure(len(names), self.nbytes, write, names, values)

    def backend_exists(self, keys: Sequence[str]) -> None:
        found = self.timers["exists"].measure(len(keys), 0, self.backend.batch_exists, keys)
        if found != len(keys):
            raise BenchError(
                f"backend {self.name!r} reports {found} of {len(keys)} just-stored keys exist"
            )

    def backend_get(self, keys: Sequence[str], values: Sequence[memoryview]) -> None:
        _zero(self.outs)
        get = self.backend.batch_get
        hits = self.timers["get"].measure(len(keys), self.nbytes, get, keys, self.outs)
        self.verified += _verify(f"backend {self.name!r}", keys, hits, self.outs, values)

    def raw_read(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        if self.baseline is None:
            return
        _zero(self.outs)
        read = self.baseline.batch_read
        self.timers["raw_read"].measure(len(names), self.nbytes, read, names, self.views)
        who = f"the raw baseline of {self.name!r}"
        self.verified += _verify(who, names, [True] * len(names), self.outs, values)

    def stats(self, cleanup: str) -> PageSizeStats:
        timers = self.timers
        set_stats, get_stats = timers["set"].stats(), timers["get"].stats()
        raw_write = timers["raw_write"].stats() if self.baseline is not None else None
        raw_read = timers["raw_read"].stats() if self.baseline is not None else None
        return PageSizeStats(
            page_size=self.page_size,
            set=set_stats,
            exists=timers["exists"].stats(moves_bytes=False),
            get=get_stats,
            raw_write=raw_write,
            raw_read=raw_read,
            set_ratio=_ratio(set_stats, raw_write),
            get_ratio=_ratio(get_stats, raw_read),
            verified=self.verified,
            cleanup=cleanup,
        )


def _bench_page_size(
    name: str,
    options: msgspec.Struct,
    baseline_type: Any,
    page_size: int,
    *,
    batch_size: int,
    batches: int,
    repeat: int,
    run_id: str,
    rng: np.random.Generator,
    progress: Progress,
) -> PageSizeStats:
    per_repeat = batch_size * batches
    # One random block; value (r, i) is a zero-copy slice starting _STRIDE bytes after the
    # previous one, so every value of the run differs while generation stays cheap.
    block = memoryview(rng.bytes(page_size + repeat * per_repeat * _STRIDE))
    label = f"{name} {format_size(page_size)}"
    parts = [slice(b * batch_size, (b + 1) * batch_size) for b in range(batches)]

    backend = create_backend(name, options, layers=_LAYERS)
    try:
        baseline = None if baseline_type is None else baseline_type(options, Deployment())
    except BaseException:
        backend.close()
        raise
    bench = _Round(name, backend, baseline, page_size, batch_size)
    try:
        for rep in range(repeat):
            first = rep * per_repeat
            values = [
                block[(first + i) * _STRIDE : (first + i) * _STRIDE + page_size]
                for i in range(per_repeat)
            ]
            keys = [f"bench-{run_id}-{page_size}-{rep}-{i}" for i in range(per_repeat)]
            names = [f"raw-{run_id}-{page_size}-{rep}-{i}" for i in range(per_repeat)]
            where = f"{label}: repeat {rep + 1}/{repeat}"

            # Interleave batch by batch and alternate who goes first, so both sides see the
            # same state of the store (dirty pages, cache warmth) as nearly as possible.
            progress(f"{where}: write")
            for b, part in enumerate(parts):
                ks, ns, vs = keys[part], names[part], values[part]
                if (rep + b) % 2 == 0:
                    bench.backend_set(ks, vs)
                    bench.raw_write(ns, vs)
                else:
                    bench.raw_write(ns, vs)
                    bench.backend_set(ks, vs)
            progress(f"{where}: exists")
            for part in parts:
                bench.backend_exists(keys[part])
            progress(f"{where}: read")
            for b, part in enumerate(parts):
                ks, ns, vs = keys[part], names[part], values[part]
                if (rep + b) % 2 == 0:
                    bench.backend_get(ks, vs)
                    bench.raw_read(ns, vs)
                else:
                    bench.raw_read(ns, vs)
                    bench.backend_get(ks, vs)
        cleanup = _cleanup(backend, bench.written)
    finally:
        try:
            if baseline is not None:
                baseline.close()
        finally:
            backend.close()
    return bench.stats(cleanup)


V1_LAYERS = 4
V1_TOKENS = 16
_V1_UNIT = 2 * V1_LAYERS * V1_TOKENS * 2
"""A v1 page is an MHA page of V1_TOKENS tokens, V1_LAYERS layers, one bf16 head: page sizes
must be multiples of this many bytes (the head dimension makes up the rest)."""


def _v1_pool(page_size: int, pages: int, layout: str) -> Any:
    from hicache_storage.hostpool import MHAHostPool

    if page_size % _V1_UNIT:
        raise ConfigError(
            f"v1 page sizes must be multiples of {_V1_UNIT} bytes ({V1_TOKENS} tokens x "
            f"{V1_LAYERS} layers x K/V x bf16), got {page_size}"
        )
    return MHAHostPool(
        pages * V1_TOKENS,
        V1_TOKENS,
        V1_LAYERS,
        1,
        page_size // _V1_UNIT,
        layout=layout,
        pin_memory=False,
        shared=sys.platform == "linux",
    )


def _bench_page_size_v1(
    name: str,
    options: msgspec.Struct,
    baseline_type: Any,
    page_size: int,
    *,
    batch_size: int,
    batches: int,
    repeat: int,
    run_id: str,
    layout: str,
    progress: Progress,
) -> PageSizeStats:
    import torch

    pages = batch_size * batches
    pool = _v1_pool(page_size, pages, layout)
    grid = pool.kv_buffer.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(int(run_id, 16) % (1 << 31))
    grid.copy_(torch.randint(0, 256, grid.shape, dtype=torch.uint8, generator=gen))
    expected = grid.clone()
    label = f"{name} v1 {format_size(page_size)}"
    parts = [list(range(b * batch_size, (b + 1) * batch_size)) for b in range(batches)]
    indices = [
        [t for p in part for t in range(p * V1_TOKENS, (p + 1) * V1_TOKENS)] for part in parts
    ]
    timers = {op: _Timer(op) for op in ("set", "exists", "get", "raw_write", "raw_read")}
    nbytes = batch_size * page_size
    written: list[str] = []
    verified = 0

    def blank(index: list[int]) -> None:
        for views in pool.page_buffer_views(index):
            for view in views:
                np.frombuffer(view, dtype=np.uint8).fill(0)

    base = grid.data_ptr()
    wanted = expected.numpy()

    def check(who: str, hits: Sequence[bool], index: list[int]) -> int:
        """Count the batch's pages once each holds its own bytes again.

        The pool's other pages are compared once per read pass: comparing the whole pool after
        every batch made the check quadratic in the pool's size.
        """
        n = len(hits)
        if not all(hits):
            raise BenchError(f"{who} missed {hits.count(False)} of {n} pages it had just stored")
        for views in pool.page_buffer_views(index):
            for view in views:
                got = np.frombuffer(view, dtype=np.uint8)
                at = got.ctypes.data - base
                if not np.array_equal(got, wanted[at : at + got.size]):
                    raise BenchError(f"{who} loaded wrong bytes into the host pool")
        return n

    backend = create_backend(name, options, layers=_LAYERS)
    baseline = None
    try:
        if baseline_type is not None:
            baseline = baseline_type(options, Deployment())
            if not all(hasattr(baseline, call) for call in V1_CALLS):
                raise ConfigError(f"the raw baseline of {name!r} has no v1 mode")
            baseline.register_host_pool(pool)
        backend.register_host_pool(pool)
        for rep in range(repeat):
            keys = [[f"bench-{run_id}-v1-{page_size}-{rep}-{p}" for p in part] for part in parts]
            names = [[f"raw-{run_id}-v1-{page_size}-{rep}-{p}" for p in part] for part in parts]
            where = f"{label}: repeat {rep + 1}/{repeat}"
            progress(f"{where}: write")
            for b, index in enumerate(indices):
                steps = [("set", backend.batch_set_v1, keys[b])]
                if baseline is not None:
                    steps.append(("raw_write", baseline.batch_write_v1, names[b]))
                for op, call, ks in steps if (rep + b) % 2 == 0 else steps[::-1]:
                    stored = timers[op].measure(len(ks), nbytes, call, ks, index)
                    if op == "set":
                        written.extend(ks)
                        if not all(stored):
                            raise BenchError(f"backend {name!r} failed to store v1 pages")
            progress(f"{where}: exists")
            for ks in keys:
                found = timers["exists"].measure(len(ks), 0, backend.batch_exists, ks)
                if found != len(ks):
                    raise BenchError(f"backend {name!r} reports {found} of {len(ks)} pages exist")
            progress(f"{where}: read")
            for b, index in enumerate(indices):
                steps = [("get", backend.batch_get_v1, keys[b])]
                if baseline is not None:
                    steps.append(("raw_read", baseline.batch_read_v1, names[b]))
                for op, call, ks in steps if (rep + b) % 2 == 0 else steps[::-1]:
                    blank(index)
                    hits = timers[op].measure(len(ks), nbytes, call, ks, index)
                    who = f"backend {name!r}" if op == "get" else f"the raw baseline of {name!r}"
                    verified += check(who, [True] * len(ks) if hits is None else hits, index)
            if not torch.equal(grid, expected):
                raise BenchError(f"a read of {name!r} wrote outside its pages in the host pool")
        cleanup = _cleanup(backend, written)
    finally:
        try:
            if baseline is not None:
                baseline.close()
        finally:
            backend.close()
    set_stats, get_stats = timers["set"].stats(), timers["get"].stats()
    raw_write = timers["raw_write"].stats() if baseline is not None else None
    raw_read = timers["raw_read"].stats() if baseline is not None else None
    return PageSizeStats(
        page_size=page_size,
        set=set_stats,
        exists=timers["exists"].stats(moves_bytes=False),
        get=get_stats,
        raw_write=raw_write,
        raw_read=raw_read,
        set_ratio=_ratio(set_stats, raw_write),
        get_ratio=_ratio(get_stats, raw_read),
        verified=verified,
        cleanup=cleanup,
    )


def bench_hashing(
    *, tokens: int = 1_000_000, page_tokens: int = 64, repeat: int = 3, seed: int | None = None
) -> HashStats:
    """Time :func:`~hicache_storage.keys.page_hashes` beside raw per-page sha256.

    The tokens are an int64 array (what a torch ``long`` tensor gives), so ``page_hashes`` pays
    its conversion as it does in serving; the raw side hashes the already converted bytes, one
    unchained ``hashlib.sha256(page).digest()`` per page.

    Raises
    ------
    BenchError
        If the first page's hash differs from raw sha256 of its bytes.
    """
    if tokens < 1 or page_tokens < 1 or repeat < 1:
        raise ConfigError("tokens, page_tokens and repeat must all be at least 1")
    ids: npt.NDArray[np.int64] = np.random.default_rng(seed).integers(
        0, 150_000, size=tokens, dtype=np.int64
    )
    raw = ids.astype("<u4").tobytes()
    step = page_tokens * 4
    pages = math.ceil(tokens / page_tokens)
    view = memoryview(raw)

    seconds = raw_seconds = 0.0
    hashes: list[str] = []
    for _ in range(repeat):
        start = time.perf_counter()
        hashes = page_hashes(ids, page_tokens)
        seconds += time.perf_counter() - start
        start = time.perf_counter()
        digests = [hashlib.sha256(view[i : i + step]).digest() for i in range(0, len(raw), step)]
        raw_seconds += time.perf_counter() - start
    if len(hashes) != pages or hashes[0] != digests[0].hex():
        raise BenchError("page_hashes disagrees with sha256 on the first page; hashing is broken")

    seconds, raw_seconds = max(seconds, 1e-9), max(raw_seconds, 1e-9)
    pages_per_s = pages * repeat / seconds
    raw_pages_per_s = pages * repeat / raw_seconds
    return HashStats(
        tokens=tokens,
        page_tokens=page_tokens,
        pages=pages,
        nbytes=len(raw),
        repeat=repeat,
        seconds=seconds,
        raw_seconds=raw_seconds,
        pages_per_s=pages_per_s,
        mb_per_s=len(raw) * repeat / seconds / 1e6,
        raw_pages_per_s=raw_pages_per_s,
        raw_mb_per_s=len(raw) * repeat / raw_seconds / 1e6,
        ratio=pages_per_s / raw_pages_per_s,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hicache-storage")
    except PackageNotFoundError:
        return "unknown"


def run_bench(
    name: str,
    options: Mapping[str, Any] | str | None,
    *,
    page_sizes: Sequence[int],
    batch_size: int,
    batches: int,
    repeat: int,
    progress: Progress | None = None,
    hash_tokens: int = 1_000_000,
    hash_page_tokens: int = 64,
    mode: Literal["copy", "v1"] = "copy",
    layout: str = "page_first",
) -> BenchReport:
    """Benchmark backend ``name`` against its raw baseline at each page size.

    Parameters
    ----------
    name
        A registered backend.
    options
        The backend's options: a mapping, a JSON string, ``"@path"`` or ``None``.
    page_sizes
        Value sizes in bytes (see :func:`parse_sizes`).
    batch_size
        Keys per batch call.
    batches
        Batch calls per operation per repeat.
    repeat
        Repeats; each writes fresh keys, so first-write-wins never skips a write.
    progress
        Called with a short line before each phase.
    hash_tokens, hash_page_tokens
        Size of the page-hashing measurement.
    mode
        ``"copy"``: ``batch_set``/``batch_get`` on caller buffers. ``"v1"``: the zero-copy
        ``batch_set_v1``/``batch_get_v1`` on a registered MHA host pool of ``layout``, beside
        the baseline's v1 mode on the same page buffers.
    layout
        Host-pool layout of the v1 mode (``layer_first``, ``page_first``,
        ``page_first_direct``, ``page_head``).

    Raises
    ------
    UnknownBackendError, MissingDependencyError, ConfigError
        As :func:`~hicache_storage.create_backend` does.
    BenchError
        If the backend misses, fails a write, or returns wrong bytes.
    """
    if not page_sizes:
        raise ConfigError("give at least one page size")
    for what, value in (("batch_size", batch_size), ("batches", batches), ("repeat", repeat)):
        if value < 1:
            raise ConfigError(f"{what} must be at least 1, got {value}")
    for size in page_sizes:
        if size < 1:
            raise ConfigError(f"page sizes must be at least 1 byte, got {size}")
    report = progress or (lambda _line: None)

    spec = get_spec(name)
    _check_memory(
        spec.capabilities.persistent, max(page_sizes), batch_size, batch_size * batches * repeat
    )
    schema = spec.load_config_type()
    struct = convert(read_source(options), schema, f"{name} backend options")
    limit = spec.capabilities.max_value_size
    if limit is not None and max(page_sizes) > limit:
        raise ConfigError(
            f"backend {name!r} accepts values up to {format_size(limit)}; "
            f"page size {format_size(max(page_sizes))} is too large"
        )
    baseline_type = spec.load_baseline()
    run_id = secrets.token_hex(6)
    rng = np.random.default_rng()

    if mode not in ("copy", "v1"):
        raise ConfigError(f"mode must be 'copy' or 'v1', got {mode!r}")
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "batches": batches,
        "repeat": repeat,
        "run_id": run_id,
        "progress": report,
    }
    if mode == "v1":
        common["layout"] = layout
    else:
        common["rng"] = rng
    measure = _bench_page_size_v1 if mode == "v1" else _bench_page_size
    results = [measure(name, struct, baseline_type, size, **common) for size in page_sizes]
    report(f"page hashing: {hash_tokens} tokens in {hash_page_tokens}-token pages")
    hashing = bench_hashing(tokens=hash_tokens, page_tokens=hash_page_tokens, repeat=repeat)
    return BenchReport(
        backend=name,
        version=_version(),
        batch_size=batch_size,
        batches=batches,
        repeat=repeat,
        results=results,
        hashing=hashing,
        set_ratio=_geomean([r.set_ratio for r in results]),
        get_ratio=_geomean([r.get_ratio for r in results]),
        mode="copy" if mode == "copy" else f"v1:{layout}",
    )
