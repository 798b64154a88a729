"""Check a deployment before it serves: the traps users of hierarchical KV caches fall into.

:func:`diagnose` looks at a backend with its options and at the serving plan around it (pool
sizes, page size, SGLang's prefetch stop policy) and returns one :class:`Finding` per check:
the backend's client library is installed, its store answers, a page written comes back whole,
a second client with the same options finds it (else the engine writes pages nobody reads), a
prefetch of a typical prefix finishes within the timeout that would cut it short, the host pool
leaves room for prefetches, and a local store's disk has room. Each finding says what was found,
with the numbers, and what to change.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from .backend import StorageBackend
from .config import read_source
from .errors import ConfigError, HiCacheError, MissingDependencyError
from .factory import create_backend
from .registry import BackendSpec, get_spec
from .urls import is_url, parse_backend_url

__all__ = ["Finding", "ServingPlan", "Status", "diagnose"]

Status = Literal["ok", "warn", "fail", "skip"]

LLAMA3_8B_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
"""KV bytes a token of Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes."""

PREFETCH_ROOM = 0.5
"""SGLang (0.5.23, cache mode) starts a storage prefetch only while the host pool's occupied
tokens are under this share of its size (``docs/sglang.md``)."""

_LOCAL_PATH_OPTIONS = ("root", "path", "file_path")
"""Options that name where a backend keeps its bytes on this machine's disk."""


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """The outcome of one check: what was found (with its numbers) and what to change."""

    check: str
    status: Status
    detail: str
    fix: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServingPlan:
    """The serving engine's side of a deployment, as SGLang's flags set it.

    Attributes
    ----------
    page_tokens
        Tokens a page (``--page-size``).
    bytes_per_token
        KV bytes a token on this rank (the default: Llama-3-8B in bf16).
    device_tokens, host_tokens
        The device and host pools' sizes in tokens; ``None`` if not known.
    prefetch_policy
        SGLang's ``--hicache-storage-prefetch-policy``.
    timeout_base_s, timeout_per_ki_token_s
        The ``timeout`` policy's limit for a prefetch of ``n`` tokens:
        ``base + per_ki_token * n / 1024`` (SGLang's ``prefetch_timeout_base`` and
        ``prefetch_timeout_per_ki_token``; 0.5.23's defaults).
    prefetch_tokens
        The prefix length whose prefetch is timed.
    repeats
        Timed prefetches; the median counts.
    """

    page_tokens: int = 64
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN
    device_tokens: int | None = None
    host_tokens: int | None = None
    prefetch_policy: Literal["timeout", "best_effort", "wait_complete"] = "timeout"
    timeout_base_s: float = 1.0
    timeout_per_ki_token_s: float = 0.25
    prefetch_tokens: int = 4096
    repeats: int = 3

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.page_tokens * self.bytes_per_token

    def timeout_s(self, tokens: int) -> float:
        """Return the ``timeout`` policy's limit for a prefetch of ``tokens``."""
        return self.timeout_base_s + self.timeout_per_ki_token_s * tokens / 1024


def diagnose(backend: str, options: Any = None, plan: ServingPlan | None = None) -> list[Finding]:
    """Run every check on ``backend`` (a name or a URL) with ``options``; return the findings.

    The store is written to: a few pages under a fresh ``hicache-doctor-`` prefix, deleted
    afterwards where the backend can delete.
    """
    plan = plan or ServingPlan()
    if is_url(backend):
        backend, from_url = parse_backend_url(backend)
        options = {**from_url, **read_source(options)}
    spec = get_spec(backend)
    findings = [_host_pool(plan), _installed(spec)]
    if findings[-1].status == "ok":
        findings += _with_store(spec, options, plan)
    findings.append(_disk(read_source(options), plan))
    return findings


def _host_pool(plan: ServingPlan) -> Finding:
    check = "host pool"
    device, host = plan.device_tokens, plan.host_tokens
    if device is None or host is None:
        return Finding(check, "skip", "pool sizes not given (--device-tokens, --host-tokens)")
    ratio = host / device
    if host <= device:
        return Finding(
            check,
            "fail",
            f"the host pool ({host:,} tokens) is not larger than the device pool "
            f"({device:,}): it holds no page the device does not, and storage prefetches land "
            "in it",
            "make the host pool larger than the device pool (--hicache-ratio above 1, 2 or "
            "more for prefetches)",
        )
    if ratio <= 1 / PREFETCH_ROOM:
        return Finding(
            check,
            "warn",
            f"host pool {ratio:.2g}x the device pool: SGLang prefetches from storage only while "
            f"the host pool is under {PREFETCH_ROOM:.0%} full, and backups of a full device "
            f"pool already fill {1 / ratio:.0%} of it",
            f"--hicache-ratio above {1 / PREFETCH_ROOM:g} lets prefetches run while the device "
            "pool is full",
        )
    return Finding(check, "ok", f"host pool {ratio:.2g}x the device pool")


def _installed(spec: BackendSpec) -> Finding:
    check = "client library"
    if spec.installed():
        return Finding(check, "ok", f"{spec.name}: {', '.join(spec.requires) or 'no extra'}")
    missing = [m for m in spec.requires if not _importable(m)]
    extra = f"pip install '{spec.distribution}[{spec.extra}]'" if spec.extra else ""
    return Finding(
        check,
        "fail",
        f"backend {spec.name!r} needs {', '.join(missing)}, which is not installed",
        extra or f"reinstall {spec.distribution}",
    )


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _with_store(spec: BackendSpec, options: Any, plan: ServingPlan) -> list[Finding]:
    """Open the store, write and read pages, open a second client; the findings in order."""
    started = time.perf_counter()
    try:
        first = create_backend(spec.name, options)
    except MissingDependencyError as exc:
        return [Finding("reachable", "fail", str(exc))]
    except ConfigError as exc:
        return [
            Finding(
                "reachable",
                "fail",
                f"{type(exc).__name__}: {exc}",
                "pass the backend's options with --config (a JSON object or @file)",
            )
        ]
    except HiCacheError as exc:
        return [
            Finding(
                "reachable",
                "fail",
                f"{type(exc).__name__}: {exc}",
                "start the server or correct its address; `hicache check` runs every check",
            )
        ]
    opened_s = time.perf_counter() - started
    prefix = f"hicache-doctor-{secrets.token_hex(6)}"
    pages = max(1, math.ceil(plan.prefetch_tokens / plan.page_tokens))
    keys = [f"{prefix}-{i}" for i in range(pages)]
    findings = [Finding("reachable", "ok", f"opened in {opened_s * 1000:.0f} ms")]
    try:
        page = os.urandom(plan.page_bytes)
        written = first.set(keys[0], page)
        got = first.get(keys[0])
        size = _size(plan.page_bytes)
        if not written or got is None or bytes(got) != page:
            what = "was refused (set returned False)" if not written else "did not come back whole"
            findings.append(
                Finding(
                    "round trip",
                    "fail",
                    f"one {size} page {what}",
                    "run `hicache check` on this backend: its report names the failing contract",
                )
            )
            return findings
        findings.append(Finding("round trip", "ok", f"one {size} page came back whole"))
        findings.append(_second_client(spec, options, keys[0], page))
        findings.append(_prefetch_time(first, keys, page, plan))
        findings.append(_capacity(first.stats(), plan))
    finally:
        if spec.capabilities.delete:
            for key in keys:
                try:
                    first.delete(key)
                except HiCacheError:
                    break
        first.close()
    return findings


def _second_client(spec: BackendSpec, options: Any, key: str, page: bytes) -> Finding:
    check = "read back by another client"
    if not spec.capabilities.shared:
        return Finding(
            check,
            "warn",
            f"{spec.name} keeps pages in this process only: other ranks, other servers and a "
            "restarted server never read what it wrote",
            "use a backend that claims 'shared' (`hicache backends`) for pages that outlive "
            "the process",
        )
    try:
        with create_backend(spec.name, options) as second:
            got = second.get(key)
    except HiCacheError as exc:
        return Finding(check, "fail", f"a second client failed: {type(exc).__name__}: {exc}")
    if got is None or bytes(got) != page:
        return Finding(
            check,
            "fail",
            "a second client with the same options does not find the page the first wrote: "
            "the engine would write pages that are never read back",
            "give every rank and server the same namespace options (prefix, root, bucket)",
        )
    return Finding(check, "ok", "a second client with the same options reads the page")


def _prefetch_time(
    backend: StorageBackend, keys: Sequence[str], page: bytes, plan: ServingPlan
) -> Finding:
    check = "prefetch time"
    tokens = len(keys) * plan.page_tokens
    stored = backend.batch_set(list(keys), [page] * len(keys))
    if not all(stored):
        return Finding(
            check,
            "warn",
            f"the store took {sum(map(bool, stored))} of {len(keys)} pages of a {tokens:,}-token "
            "prefix",
            "a bounded store smaller than one prefix keeps none of it: raise its bound",
        )
    outs = [bytearray(len(page)) for _ in keys]
    times = []
    for _ in range(plan.repeats):
        started = time.perf_counter()
        hits = backend.batch_get(list(keys), outs)
        times.append(time.perf_counter() - started)
        if not all(hits):
            return Finding(
                check,
                "fail",
                f"{hits.count(False)} of {len(keys)} pages just written were misses on reading",
                "run `hicache check` on this backend: its report names the failing contract",
            )
    fetch_s = statistics.median(times)
    size = _size(len(keys) * len(page))
    took = f"a {tokens:,}-token prefix ({len(keys)} pages, {size}) reads in {fetch_s:.3f} s"
    if plan.prefetch_policy == "best_effort":
        return Finding(
            check,
            "warn",
            f"{took}; best_effort stops a prefetch when the request is scheduled, so most end "
            "before any page arrives",
            "--hicache-storage-prefetch-policy timeout",
        )
    if plan.prefetch_policy == "wait_complete":
        return Finding(check, "ok", f"{took}; wait_complete waits for every page")
    limit = plan.timeout_s(tokens)
    if fetch_s > limit:
        return Finding(
            check,
            "fail",
            f"{took}; the timeout policy stops it after {limit:.3f} s, so such prefetches end "
            "short and the pages written are not read back",
            "raise prefetch_timeout_base / prefetch_timeout_per_ki_token in the extra config, "
            "or use a faster store",
        )
    return Finding(check, "ok", f"{took}, within the timeout's {limit:.3f} s")


def _capacity(stats: Mapping[str, Any], plan: ServingPlan) -> Finding:
    """How full the store is, from ``stats()["capacity"]``: the traps of its bound and policy."""
    check = "capacity"
    capacity: Mapping[str, Any] | None = stats.get("capacity")
    if capacity is None:
        if stats.get("capacity_error"):
            return Finding(
                check,
                "warn",
                f"the store's figures could not be read: {stats['capacity_error']}",
                "check the address the backend reads them from (its page says which)",
            )
        return Finding(check, "skip", "the backend reports no capacity figures")
    used, bound = capacity.get("used_bytes"), capacity.get("bound_bytes")
    evictions, policy = capacity.get("evictions"), capacity.get("policy")
    held = f"{_size(used)} used" if isinstance(used, int) else "use unknown"
    if bound is None:
        if capacity.get("scope") == "server":
            return Finding(
                check,
                "warn",
                f"{held} and no bound: the server grows until the machine's memory runs out",
                "set maxmemory and maxmemory-policy allkeys-lru on the server",
            )
        return Finding(check, "ok", f"{held}, no bound (see disk space)")
    if policy == "noeviction":
        return Finding(
            check,
            "warn",
            f"{held}; the server refuses every write once full (maxmemory-policy noeviction)",
            "set maxmemory-policy allkeys-lru: a cache tier evicts",
        )
    pool = plan.host_tokens * plan.bytes_per_token if plan.host_tokens is not None else None
    if pool is not None and bound < pool:
        return Finding(
            check,
            "warn",
            f"a bound of {_size(bound)} holds less than one host pool ({_size(pool)}): "
            "pages are evicted before they are read back",
            "raise the store's bound (max_bytes, maxmemory, the segments mounted)",
        )
    share = f" ({used / bound:.0%})" if isinstance(used, int) and bound else ""
    tail = f", {evictions} evicted" if isinstance(evictions, int) else ""
    tail += f", policy {policy}" if policy else ""
    return Finding(check, "ok", f"{held} of {_size(bound)}{share}{tail}")


def _disk(options: Mapping[str, Any], plan: ServingPlan) -> Finding:
    check = "disk space"
    paths = [Path(str(options[name])) for name in _LOCAL_PATH_OPTIONS if options.get(name)]
    if not paths:
        return Finding(check, "skip", "no local path among the options: no disk to check")
    where = paths[0]
    existing = next((p for p in (where, *where.parents) if p.exists()), None)
    if existing is None:
        return Finding(check, "skip", f"{where} is not on this machine")
    usage = shutil.disk_usage(existing)
    bound = options.get("max_bytes")
    free = f"{_size(usage.free)} free of {_size(usage.total)} at {existing}"
    if isinstance(bound, int) and bound > usage.free:
        return Finding(
            check,
            "warn",
            f"{free}: less than the store's max_bytes ({_size(bound)}), so the disk fills "
            "before the store evicts",
            "lower max_bytes or free the disk",
        )
    if plan.host_tokens is not None and usage.free < plan.host_tokens * plan.bytes_per_token:
        return Finding(
            check,
            "warn",
            f"{free}: less than one host pool's pages "
            f"({_size(plan.host_tokens * plan.bytes_per_token)})",
            "free the disk or bound the store (max_bytes)",
        )
    if bound is None:
        return Finding(
            check,
            "ok",
            f"{free}; the store has no max_bytes and grows until the disk is full",
        )
    return Finding(check, "ok", free)


def _size(nbytes: int) -> str:
    """Format a byte count in the largest IEC unit it reaches (``8.0 MiB``)."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if nbytes >= 1024**power:
            return f"{nbytes / 1024**power:.1f} {unit}"
    return f"{nbytes} B"
