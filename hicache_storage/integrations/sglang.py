"""Run any hicache-storage backend as an SGLang HiCache storage backend.

SGLang loads a storage backend it does not ship through its ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hicache", "module_path": "hicache_storage.integrations.sglang",
        "class_name": "SGLangStorage", "interface_v1": 1,
        "backend": "redis", "options": {"url": "redis://127.0.0.1:6379/0"}}'

:class:`SGLangStorage` is SGLang's ``HiCacheStorage``: SGLang constructs it as
``SGLangStorage(storage_config, {})``; it reads our configuration (``backend``, ``options``,
``layers``, ``deployment``, or ``config`` with a whole config source) from the extra config,
takes this rank's position from SGLang's ``HiCacheStorageConfig``, and builds the backend with
:func:`hicache_storage.open_backend`'s default layers, so storage failures are counted misses.
SGLang passes bare page hashes; the adapter turns them into keys with the deployment's key
scheme (``HiCacheFile``'s names followed by the host pool's object-format tag, or exactly
``HiCacheFile``'s names where the backend stores them for SGLang, ``foreign_names``, and guards
the format itself) and moves pages zero-copy between SGLang's
host pool, adopted in place as a :class:`~hicache_storage.hostpool.HostKVPool`, and the backend.
Between SGLang and the backend sits the planner
(:mod:`~hicache_storage.integrations.sglang_planner`): existence queries answer only the pages
whose fetch pays, and writes the store cannot absorb are shed at once instead of holding SGLang's
backup thread.

This module is the only one that imports SGLang (``docs/sglang.md``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import msgspec
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import (
    HiCacheConfig,
    env_overrides,
    load_config,
    read_source,
    require_backend,
)
from hicache_storage.errors import ConfigError, HostPoolError, InvalidValueError
from hicache_storage.factory import open_backend
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool, UnifiedObjectPool
from hicache_storage.keys import (
    ObjectFormat,
    RankSuffixScheme,
    UnifiedPlan,
    kv_settings,
    logical_dtype,
    model_identity,
    weights_fingerprint,
)
from hicache_storage.keys.identity import local_snapshot
from hicache_storage.layers import watch_planner

from .sglang_planner import ReadCall, SGLangPlanner, planner_settings

__all__ = ["SGLANG_KEYS", "SGLangStorage", "adopt_host_pool", "config_from"]

logger = logging.getLogger(__name__)

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Extra-config keys that belong to SGLang (its factory and controllers); the adapter ignores them.

SGLang's server takes the prefetch keys and ``tp_lcm_size`` out before the adapter sees the
config; a controller built directly passes them through."""

ADAPTER_KEYS = frozenset({"model_path", "model_overrides", "planner"})
"""Extra-config keys of the adapter itself, besides our config's: ``model_path`` names the
checkpoint SGLang serves when its model name is not that path (``--served-model-name``),
``model_overrides`` repeats SGLang's ``--json-model-override-args`` (see
:func:`served_model_identity`), and ``planner`` sets the planner
(:func:`~hicache_storage.integrations.sglang_planner.planner_settings`)."""

_PROBE_HASH = "0" * 64
"""The page hash the registration probe reads: a well-formed hash no page has."""

_CONFIG_KEYS = frozenset({"config", *ADAPTER_KEYS, *HiCacheConfig.__struct_fields__})
_MAPPED_LAYOUTS = {
    "MHATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "MLATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct"),
}


def _extra_data(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Our config as data from SGLang's extra config: ``config`` first, then the inline keys."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - SGLANG_KEYS - _CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in the hicache-storage extra config; it takes "
            f"{sorted(_CONFIG_KEYS)} besides SGLang's {sorted(SGLANG_KEYS)}"
        )
    data = read_source(extra.pop("config", None))
    for key in HiCacheConfig.__struct_fields__:
        if key in extra:
            data[key] = extra[key]
    return read_source(data)  # the inline keys' nesting and integers checked as a file's are


def served_model_identity(storage_config: HiCacheStorageConfig) -> str:
    """Return the identity of the model SGLang serves: its weights and KV settings, or its name.

    SGLang tells a storage backend only the model's name, which is its ``--model-path`` unless
    ``--served-model-name`` renames it; the extra config's ``model_path`` names the checkpoint
    then. For a checkpoint found locally (a directory, or a hub id in the local Hugging Face
    cache) the identity is :func:`~hicache_storage.keys.model_identity` of its sampled weights
    and the KV settings of its ``config.json``; otherwise it is the name, as before. SGLang's
    ``--json-model-override-args`` does not reach a storage backend: a deployment that overrides
    a KV setting (RoPE, sliding window) passes the same object as ``model_overrides``.

    Raises
    ------
    ConfigError
        If ``model_path`` is not a string or ``model_overrides`` not an object.
    """
    name = storage_config.model_name or ""
    extra = storage_config.extra_config or {}
    path = extra.get("model_path", name)
    if not isinstance(path, str):
        raise ConfigError(f"model_path must be a string, got {type(path).__name__}")
    overrides = extra.get("model_overrides") or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"model_overrides must be an object, got {type(overrides).__name__}")
    local = Path(path) if path and Path(path).exists() else local_snapshot(path, None)
    if local is None and not overrides:
        return name
    settings: dict[str, Any] = {}
    if local is not None:
        config_file = (local if local.is_dir() else local.parent) / "config.json"
        settings = json.loads(config_file.read_text()) if config_file.is_file() else {}
    settings = kv_settings({**settings, **overrides})
    weights = weights_fingerprint(path if local is None else local)
    return model_identity(path or name, weights, settings)


def _rank_facts(storage_config: HiCacheStorageConfig) -> dict[str, Any]:
    """Return the rank's position as SGLang states it, in our deployment's terms."""
    if storage_config.dcp_size > 1:
        raise ConfigError(
            f"decode context parallelism (dcp_size={storage_config.dcp_size}) has no "
            "hicache-storage key definition yet; run without --dcp-size or use SGLang's own backend"
        )
    if storage_config.should_split_heads:
        raise ConfigError(
            "split heads (tp_lcm_size > tp_size with the page_head layout) have no "
            "hicache-storage key definition yet; use the unified key scheme's head grid instead "
            "of tp_lcm_size"
        )
    return {
        "model_name": storage_config.model_name or "",
        "tp_rank": storage_config.tp_rank,
        "tp_size": storage_config.tp_size,
        "pp_rank": storage_config.pp_rank,
        "pp_size": storage_config.pp_size,
        "cp_rank": storage_config.attn_cp_rank,
        "cp_size": storage_config.attn_cp_size,
        "is_mla": bool(storage_config.is_mla_model),
    }


def config_from(storage_config: HiCacheStorageConfig, *, model: str | None = None) -> HiCacheConfig:
    """Build our config from SGLang's storage config and the extra config it carries.

    The model name, attention-TP, PP and attention-CP ranks and sizes and whether KV is
    replicated (MLA) come from SGLang; ``key_scheme`` and ``unified`` from the extra config.
    SGLang's ``tp_lcm_size`` fills the unified scheme's head grid when the config leaves it
    open, and ``model`` (the :func:`served_model_identity`) its ``model_id``. ``HICACHE_*``
    environment variables override the result, as in
    :func:`~hicache_storage.config.load_config`.

    Raises
    ------
    ConfigError
        If the extra config is malformed, names unknown keys or no ``backend`` (here, in
        ``config`` or ``HICACHE_BACKEND``), for decode context parallelism
        or split heads (no key definition yet), or when the config, a config file or a
        ``HICACHE_*`` environment variable states a rank field that contradicts SGLang's.
    """
    data = _extra_data(storage_config.extra_config)
    require_backend(data, "the hicache-storage extra config")
    deployment = data.get("deployment") or {}
    if not isinstance(deployment, Mapping):
        raise ConfigError(f"deployment must be an object, got {type(deployment).__name__}")
    deployment = dict(deployment)
    from_env = env_overrides(os.environ).get("deployment")
    from_env = from_env if isinstance(from_env, Mapping) else {}
    for name, value in _rank_facts(storage_config).items():
        if name in deployment and deployment[name] != value:
            raise ConfigError(
                f"deployment.{name}={deployment[name]!r} contradicts SGLang's {value!r}; leave "
                "the rank position out of the config, the adapter takes it from SGLang"
            )
        if name in from_env and from_env[name] != value:
            raise ConfigError(
                f"HICACHE_DEPLOYMENT__{name.upper()}={from_env[name]!r} contradicts SGLang's "
                f"{value!r}; every rank inherits the environment, so the adapter takes the rank "
                "position only from SGLang: unset the variable"
            )
        deployment[name] = value
    unified = deployment.get("unified")
    if isinstance(unified, Mapping) and model and not unified.get("model_id"):
        unified = deployment["unified"] = {**unified, "model_id": model}
    lcm = storage_config.tp_lcm_size
    if (
        isinstance(unified, Mapping)
        and lcm is not None
        and unified.get("head_group") is None
        and unified.get("tp_lcm_size") is None
    ):
        deployment["unified"] = {**unified, "tp_lcm_size": lcm}
    data["deployment"] = deployment
    return load_config(data)


def adopt_host_pool(pool: Any) -> HostKVPool:
    """Wrap SGLang's host pool in place (no copy) as our host pool.

    Maps ``MHATokenToKVPoolHost`` (``layer_first``, ``page_first``, ``page_first_direct``,
    ``page_head``) and ``MLATokenToKVPoolHost`` (``layer_first``, ``page_first``,
    ``page_first_direct``): the adopted pool's ``kv_buffer`` is SGLang's tensor, and its page
    objects are byte-identical to SGLang's ``get_data_page(i, flat=True)``.

    Raises
    ------
    HostPoolError
        Naming the pool class and layout, for anything else: other pool classes (asymmetric
        K/V widths, K-only and sparse pools), the ``page_unified`` layout, decode context
        parallel pools, and buffers that are not one CPU tensor.
    """
    kind = type(pool).__name__
    layout = str(getattr(pool, "layout", "?"))
    layouts = _MAPPED_LAYOUTS.get(kind)
    if layouts is None:
        mapped = ", ".join(f"{name} ({', '.join(ls)})" for name, ls in _MAPPED_LAYOUTS.items())
        raise HostPoolError(
            f"cannot map SGLang host pool {kind} (layout {layout!r}) onto a hicache-storage "
            f"host pool; mapped pools: {mapped}"
        )
    if layout not in layouts:
        raise HostPoolError(
            f"cannot map SGLang {kind} with layout {layout!r}; mapped layouts: {', '.join(layouts)}"
        )
    if getattr(pool, "dcp_size", 1) > 1:
        raise HostPoolError(f"cannot map SGLang {kind} with decode context parallelism")
    kv_buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(kv_buffer, torch.Tensor):
        raise HostPoolError(
            f"cannot map SGLang {kind} (layout {layout!r}): its kv_buffer is a "
            f"{type(kv_buffer).__name__}, not one tensor"
        )
    cls = MLAHostPool if kind == "MLATokenToKVPoolHost" else MHAHostPool
    adopted = cls.from_buffer(kv_buffer, int(pool.page_size), layout)
    if adopted.size != int(pool.size):
        raise HostPoolError(
            f"SGLang {kind} has {pool.size} token slots but its kv_buffer holds {adopted.size}"
        )
    return adopted


class _FlatPagePool:
    """A sidecar pool we cannot adopt, moved through SGLang's own flat-page calls (one copy)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)

    def read(
        self, backend: StorageBackend, keys: Sequence[str], starts: Sequence[int]
    ) -> list[bool]:
        hits = []
        for key, start in zip(keys, starts, strict=True):
            page = self.pool.get_dummy_flat_data_page()
            hit = backend.get(key, _bytes_of(page)) is not None
            if hit:
                self.pool.set_from_flat_data_page(start, page)
            hits.append(hit)
        return hits

    def write(
        self, backend: StorageBackend, keys: Sequence[str], starts: Sequence[int]
    ) -> list[bool]:
        values = [_bytes_of(self.pool.get_data_page(start, flat=True)) for start in starts]
        return backend.batch_set(keys, values)


class _AdoptedPool:
    """A sidecar pool adopted in place, moved through the backend's generic batch calls."""

    def __init__(self, pool: HostKVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    def read(
        self, backend: StorageBackend, keys: Sequence[str], starts: Sequence[int]
    ) -> list[bool]:
        outs = [bytearray(self.pool.page_nbytes) for _ in starts]
        hits = backend.batch_get(keys, outs)
        for hit, start, out in zip(hits, starts, outs, strict=True):
            if hit:
                self.pool.write_page(start, out)
        return hits

    def write(
        self, backend: StorageBackend, keys: Sequence[str], starts: Sequence[int]
    ) -> list[bool]:
        values = []
        for start in starts:
            out = bytearray(self.pool.page_nbytes)
            self.pool.read_page(start, out)
            values.append(out)
        return backend.batch_set(keys, values)


def _pool_name(name: Any) -> str:
    """Return a pool's name as text (SGLang passes ``PoolName`` members or strings)."""
    return str(getattr(name, "value", name))


def _spread(done: Sequence[bool], positions: Sequence[int], pages: int) -> list[bool]:
    """Per-page results of ``pages`` pages, from those of the pages at ``positions``."""
    results = [False] * pages
    for position, ok in zip(positions, done, strict=True):
        results[position] = bool(ok)
    return results


def _bytes_of(tensor: Any) -> memoryview:
    """Return a writable byte view of a contiguous CPU tensor (no copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return as_writable(tensor)


class _Calls:
    """Pages and bandwidth per storage call, drained into SGLang's ``StorageMetrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._lists[f"{kind}_pgs"].append(pages)
            self._lists[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> dict[str, list[float]]:
        with self._lock:
            out = {name: list(values) for name, values in self._lists.items()}
            for values in self._lists.values():
                values.clear()
        return out


class SGLangStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no type information
    """SGLang's ``HiCacheStorage`` over any registered hicache-storage backend.

    Parameters
    ----------
    storage_config
        SGLang's ``HiCacheStorageConfig``; its ``extra_config`` carries our configuration.
    kwargs
        What SGLang's dynamic factory passes (an empty dict); unused.

    The planner (on unless the extra config says ``"planner": false``) decides, from the rates
    it measures, which stored pages an existence query answers and which writes reach the store
    (:mod:`~hicache_storage.integrations.sglang_planner`); :meth:`stats` counts its decisions.

    Raises
    ------
    ConfigError
        If the extra config is malformed, names unknown keys or an unknown backend, or the
        deployment has no key definition (decode context parallelism, split heads).
    BackendError
        With ``"strict_start": true``, if the backend cannot be reached when it is built;
        otherwise the adapter starts with the store detached (every call a counted miss,
        logged as an error) and attaches it once it answers.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.model_identity = served_model_identity(storage_config)
        """The model the stored KV belongs to (:func:`served_model_identity`): the host pool's
        object-format tag and the unified namespace carry it, so new weights or KV settings
        under one name never read the old KV. SGLang's exact names (``foreign_names``) do not."""
        self.config = config_from(storage_config, model=self.model_identity)
        self.planner_settings = planner_settings(storage_config.extra_config)
        deployment = self.config.deployment
        self.backend: StorageBackend = open_backend(self.config)
        self._scheme = deployment.scheme()
        self._rank_suffix = deployment.rank_suffix()
        self._tp_scheme = msgspec.structs.replace(deployment, is_mla=False).rank_suffix()
        self._pools: dict[str, _AdoptedPool | _FlatPagePool] = {}
        self._kv_pool: HostKVPool | UnifiedObjectPool | None = None
        self._page_nbytes = 0
        self._planner: SGLangPlanner | None = None
        self._calls = _Calls() if storage_config.enable_storage_metrics else None
        self._closed = False

    # -- keys -------------------------------------------------------------------------------------

    @property
    def _unified(self) -> UnifiedPlan | None:
        return self._scheme if isinstance(self._scheme, UnifiedPlan) else None

    def _kv_keys(self, page_hashes: Sequence[str]) -> list[str]:
        return self._scheme.keys(page_hashes)

    def _sidecar_keys(self, name: str, page_hashes: Sequence[str]) -> list[str]:
        """``HiCacheFile``'s sidecar names: ``<hash>.<pool><suffix>``; Mamba state is TP-sharded."""
        scheme: RankSuffixScheme = (
            self._tp_scheme if name == PoolName.MAMBA.value else self._rank_suffix
        )
        return [f"{h}.{name}{scheme.suffix}" for h in page_hashes]

    # -- host pools -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's KV host pool in place and register it with the backend.

        Raises
        ------
        HostPoolError
            If the pool's class or layout cannot be mapped (the message names it), or it does
            not match the unified scheme's plan.
        """
        super().register_mem_pool_host(mem_pool_host)
        pool = adopt_host_pool(mem_pool_host)
        target: HostKVPool | UnifiedObjectPool = pool
        if self._unified is not None:
            target = UnifiedObjectPool(pool, self._unified_plan_for(pool))
        elif not self.backend.capabilities.foreign_names:
            fmt = ObjectFormat.of_pool(pool, model=self.model_identity)
            self._scheme = dataclasses.replace(self._rank_suffix, object_format=fmt.tag)
        self.backend.register_host_pool(target)
        self._kv_pool = target
        self._page_nbytes = pool.page_nbytes
        self._planner = self._start_planner(pool)

    def _start_planner(self, pool: HostKVPool) -> SGLangPlanner | None:
        """Build the planner at the pool's page size and probe the store's round trip."""
        if not self.planner_settings.enabled:
            return None
        planner = SGLangPlanner(
            self.planner_settings, pool.page_size, history_pages=pool.size // pool.page_size
        )
        probe = self._kv_keys([_PROBE_HASH])[0]
        planner.probe(lambda: self.backend.get(probe))
        watch_planner(planner.planner, self.backend.name)
        return planner

    def _unified_plan_for(self, pool: HostKVPool) -> UnifiedPlan:
        """Return the unified plan at the pool's page size, rebuilding the backend if it changed.

        The page size is part of the unified namespace and SGLang states it only through its
        host pool; the logical dtype comes from the config (a pool of raw bytes cannot say
        whether it holds e4m3 or e5m2), and must agree with a pool of a real dtype.
        """
        deployment = self.config.deployment
        settings = deployment.unified
        if settings is not None and pool.dtype != torch.uint8:
            stated, actual = logical_dtype(settings.dtype), logical_dtype(pool.dtype)
            if stated != actual:
                raise HostPoolError(
                    f"deployment.unified.dtype is {stated} but SGLang's host pool holds {actual}"
                )
        if deployment.page_size != pool.page_size:
            deployment = msgspec.structs.replace(deployment, page_size=pool.page_size)
            self.config = msgspec.structs.replace(self.config, deployment=deployment)
            self.backend.close()
            self.backend = open_backend(self.config)
        plan = deployment.unified_plan()
        self._scheme = plan
        return plan

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a pool of a hybrid model's host-pool group (KV included).

        Raises
        ------
        HostPoolError
            If a sidecar pool can neither be adopted nor moved through SGLang's flat pages.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name == PoolName.KV.value:
            if host_pool is not self.mem_pool_host:
                self.register_mem_pool_host(host_pool)
            return
        try:
            self._pools[name] = _AdoptedPool(adopt_host_pool(host_pool))
        except HostPoolError as exc:
            needed = ("get_dummy_flat_data_page", "get_data_page", "set_from_flat_data_page")
            if not all(callable(getattr(host_pool, m, None)) for m in needed):
                raise HostPoolError(
                    f"cannot store SGLang sidecar pool {name!r}: {exc}, and it has no flat-page "
                    f"calls ({', '.join(needed)}) to move it through"
                ) from exc
            self._pools[name] = _FlatPagePool(host_pool)

    def on_host_pools_registered(self) -> None:
        """Check that the KV pool arrived; raising here fails SGLang's attach, as it should."""
        if self._kv_pool is None:
            raise HostPoolError(
                "SGLang registered no KV host pool with the hicache-storage adapter"
            )

    # -- zero-copy page calls (interface_v1) ------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load each page hash's page into the registered host pool; per-page hits."""
        with self._read_call(len(keys)) as call:
            hits = self._pages_v1(keys, host_indices, self.backend.batch_get_v1, "prefetch")
            call.delivered = sum(hits)
        return hits

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store each page of the registered host pool under its page hash; per-page success.

        Pages the planner sheds answer ``False`` without reaching the store.
        """
        return self._planned_write(keys, lambda at: self._write_kv(keys, host_indices, at))

    def _write_kv(
        self, keys: Sequence[str], host_indices: torch.Tensor, positions: Sequence[int]
    ) -> list[bool]:
        """Store the pages at ``positions`` of ``keys`` (all of them, most often)."""
        if len(positions) < len(keys):
            size = host_indices.numel() // max(len(keys), 1)
            keys = [keys[i] for i in positions]
            host_indices = torch.cat([host_indices[i * size : (i + 1) * size] for i in positions])
        return self._pages_v1(keys, host_indices, self.backend.batch_set_v1, "backup")

    def _read_call(self, pages: int) -> AbstractContextManager[ReadCall]:
        """Return a read call for the planner to measure (its pages delivered and seconds)."""
        if self._planner is None:
            return nullcontext(ReadCall(pages, 0.0))
        return self._planner.reading(pages)

    def _planned_write(
        self,
        page_hashes: Sequence[str],
        write: Callable[[list[int]], list[bool]],
        *,
        kv_follows: bool = False,
    ) -> list[bool]:
        """Offer the pages to the planner, ``write`` the admitted positions; per-page success."""
        if self._planner is None or not page_hashes:
            return [bool(r) for r in write(list(range(len(page_hashes))))]
        results = [False] * len(page_hashes)
        with self._planner.writing(page_hashes, kv_follows=kv_follows) as call:
            if call.positions:
                results = _spread(write(call.positions), call.positions, len(page_hashes))
                call.stored = sum(results)
        return results

    def _pages_v1(
        self,
        page_hashes: Sequence[str],
        host_indices: torch.Tensor,
        call: Callable[[Sequence[str], Any], list[bool]],
        kind: str,
    ) -> list[bool]:
        pool = self._registered()
        start = time.perf_counter()
        keys = self._kv_keys(page_hashes)
        if isinstance(pool, UnifiedObjectPool):
            per_page = len(keys) // max(len(page_hashes), 1)
            done = call(keys, pool.object_indices(host_indices))
            results = [all(done[i : i + per_page]) for i in range(0, len(done), per_page)]
        else:
            results = call(keys, host_indices)
        self._record(kind, results, self._page_nbytes, start)
        return [bool(r) for r in results]

    def _registered(self) -> HostKVPool | UnifiedObjectPool:
        if self._kv_pool is None:
            raise HostPoolError(
                "no SGLang host pool is registered; SGLang calls register_mem_pool_host first"
            )
        return self._kv_pool

    def _record(self, kind: str, results: Sequence[bool], page_nbytes: int, start: float) -> None:
        if self._calls is not None:
            pages = sum(1 for r in results if r)
            self._calls.record(kind, pages, pages * page_nbytes, time.perf_counter() - start)

    # -- existence --------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether page ``key`` is stored (every object of it, under the unified scheme).

        Under the planner, whether it is stored and fetching it pays.
        """
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Return how many leading page hashes are stored.

        Under the planner, the leading stored pages only when fetching them pays, else 0.
        """
        if not keys:
            return 0
        return self._fetchable(keys, lambda: self._stored_prefix(keys))

    def _stored_prefix(self, keys: Sequence[str]) -> int:
        per_page = self._scheme.keys_per_page
        return self.backend.batch_exists(self._kv_keys(keys)) // per_page

    def _fetchable(self, keys: Sequence[str], query: Callable[[], int]) -> int:
        """Return the pages ``query`` finds stored, or what the planner answers of them."""
        if self._planner is None:
            return query()
        return self._planner.fetchable(keys, query)

    # -- generic (non-v1) calls -------------------------------------------------------------------

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """Read page ``key`` into ``target_location`` (a CPU tensor of its size), or a new one."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Read each page into its target tensor; ``None`` where it misses."""
        with self._read_call(len(keys)) as call:
            out = self._read_generic(keys, target_locations)
            call.delivered = sum(1 for t in out if t is not None)
        return out

    def _read_generic(
        self, keys: Sequence[str], target_locations: Any | None
    ) -> list[torch.Tensor | None]:
        stored = self._generic_keys(keys)
        start = time.perf_counter()
        if target_locations is None:
            values = [self.backend.get(k) for k in stored]
            out: list[torch.Tensor | None] = [
                None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)
                for v in values
            ]
        else:
            targets = list(target_locations)
            if len(targets) != len(keys):
                raise InvalidValueError(f"got {len(keys)} keys but {len(targets)} target locations")
            hits = self.backend.batch_get(stored, [_bytes_of(t) for t in targets])
            out = [t if hit else None for t, hit in zip(targets, hits, strict=True)]
        nbytes = max((t.numel() * t.element_size() for t in out if t is not None), default=0)
        self._record("prefetch", [t is not None for t in out], nbytes, start)
        return out

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store the CPU tensor ``value`` under page ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store each tensor under its page; ``True`` only if every write succeeded.

        ``False`` at once when the planner sheds the pages.
        """
        if values is None:
            raise InvalidValueError(
                "the hicache-storage adapter stores tensors passed as values; pointer-based "
                "set calls are not supported (use interface_v1 for zero-copy pages)"
            )
        values = list(values)
        if len(values) != len(keys):
            raise InvalidValueError(f"got {len(keys)} keys but {len(values)} values")
        stored = self._generic_keys(keys)
        buffers = [
            as_readable(v.contiguous() if isinstance(v, torch.Tensor) else v) for v in values
        ]
        nbytes = max((b.nbytes for b in buffers), default=0)

        def write(positions: list[int]) -> list[bool]:
            start = time.perf_counter()
            done = self.backend.batch_set(
                [stored[i] for i in positions], [buffers[i] for i in positions]
            )
            self._record("backup", done, nbytes, start)
            return done

        return all(self._planned_write(keys, write))

    def _generic_keys(self, page_hashes: Sequence[str]) -> list[str]:
        if self._unified is not None:
            raise InvalidValueError(
                "the unified key scheme stores several objects per page; SGLang must use "
                'the zero-copy page calls ("interface_v1": 1) with it'
            )
        return self._kv_keys(page_hashes)

    # -- hybrid models (v2) -----------------------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Return the usable prefix: KV pages, then each sidecar pool's hit policy.

        Under the planner, no pages where fetching the usable prefix does not pay.
        """
        result = PoolTransferResult(0, {}, [])

        def query() -> int:
            nonlocal result
            result = self._usable_prefix(keys, pool_transfers or [])
            return int(result.kv_hit_pages)

        pages = self._fetchable(keys, query) if keys else 0
        return result if pages == result.kv_hit_pages else PoolTransferResult(0, {}, [])

    def _usable_prefix(
        self, keys: Sequence[str], pool_transfers: Sequence[PoolTransfer]
    ) -> PoolTransferResult:
        kv_pages = self._stored_prefix(keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers:
            if not restorable:
                break
            name = _pool_name(transfer.name)
            present = self._sidecar_present(name, keys[:kv_pages], transfer.hit_policy)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i, p in enumerate(present) if not p), kv_pages)
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                tail = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - tail) : n])}
                boundary = max(allowed, default=0)
            else:
                raise InvalidValueError(
                    f"pool {name!r} asks for hit policy {transfer.hit_policy!r}; the "
                    "hicache-storage adapter supports all_pages and trailing_pages"
                )
            if boundary:
                hits[transfer.name] = boundary
            restorable = [n for n in restorable if n in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _sidecar_present(self, name: str, page_hashes: Sequence[str], policy: Any) -> list[bool]:
        keys = self._sidecar_keys(name, page_hashes)
        if policy == PoolHitPolicy.ALL_PAGES:
            run = self.backend.batch_exists(keys)
            return [i < run for i in range(len(keys))]
        return [self.backend.exists(k) for k in keys]

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool; per pool, per-page success."""
        return self._transfers_v2(transfers, "read")

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Write each transfer's pages from its pool; per pool, per-page success.

        Under the planner, the call's page hashes are one offer; shed pages answer ``False``.
        SGLang's hybrid controller writes an operation's sidecar pools here and its KV pages
        right after (``batch_set_v1``, on a rank that writes KV): those share this decision
        (:meth:`~hicache_storage.integrations.sglang_planner.SGLangPlanner.writing`).
        """
        if self._planner is None:
            return self._transfers_v2(transfers, "write")
        page_hashes = list(dict.fromkeys(h for t in transfers for h in t.keys or []))
        with_kv = any(_pool_name(t.name) == PoolName.KV.value for t in transfers)
        results = {t.name: [False] * len(t.keys or []) for t in transfers}

        def write(positions: list[int]) -> list[bool]:
            admitted = {page_hashes[i] for i in positions}
            results.update(self._transfers_v2(transfers, "write", admitted))
            stored = dict.fromkeys(admitted, True)
            for transfer in transfers:
                for page, ok in zip(transfer.keys or [], results[transfer.name], strict=True):
                    if page in stored:
                        stored[page] = stored[page] and ok
            return [stored[page_hashes[i]] for i in positions]

        kv_follows = not with_kv and self.storage_config.is_storage_writer
        self._planned_write(page_hashes, write, kv_follows=kv_follows)
        return results

    def _transfers_v2(
        self, transfers: Sequence[PoolTransfer], op: str, admitted: Collection[str] | None = None
    ) -> dict[str, list[bool]]:
        """Move each transfer's pages (for a write, those under ``admitted`` hashes, or all)."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = _pool_name(transfer.name)
            page_hashes = list(transfer.keys or [])
            indices = transfer.host_indices
            at = [i for i, h in enumerate(page_hashes) if admitted is None or h in admitted]
            if name == PoolName.KV.value:
                if op == "read":
                    results[transfer.name] = self.batch_get_v1(page_hashes, indices) if at else []
                else:
                    done = self._write_kv(page_hashes, indices, at) if at else []
                    results[transfer.name] = _spread(done, at, len(page_hashes))
                continue
            pool = self._pools.get(name)
            if pool is None:
                raise HostPoolError(f"SGLang pool {name!r} was not registered with the adapter")
            if not page_hashes:
                results[transfer.name] = []
                continue
            if indices is None or indices.numel() != len(page_hashes) * pool.page_size:
                got = 0 if indices is None else indices.numel()
                raise InvalidValueError(
                    f"pool {name!r}: {len(page_hashes)} pages need "
                    f"{len(page_hashes) * pool.page_size} host indices, got {got}"
                )
            starts = [int(i) for i in indices[:: pool.page_size].tolist()]
            keys = self._sidecar_keys(name, page_hashes)
            move = pool.read if op == "read" else pool.write
            done = move(self.backend, [keys[i] for i in at], [starts[i] for i in at]) if at else []
            results[transfer.name] = _spread(done, at, len(page_hashes))
        return results

    # -- housekeeping -----------------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (drained), or ``None`` when disabled."""
        if self._calls is None:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        return StorageMetrics(**self._calls.drain())

    def stats(self) -> dict[str, Any]:
        """Return the planner's decisions (``None`` when it is off) and the backend's stats.

        See :meth:`~hicache_storage.integrations.sglang_planner.SGLangPlanner.stats`.
        """
        planner = None if self._planner is None else self._planner.stats()
        return {"planner": planner, "backend": self.backend.stats()}

    def clear(self) -> None:
        """Remove this rank's objects; never raises (SGLang's flush must not fail on storage)."""
        try:
            self.backend.clear()
        except Exception:
            logger.exception("hicache-storage: clear() of backend %r failed", self.config.backend)

    def close(self) -> None:
        """Close the backend; calling it again does nothing."""
        if not self._closed:
            self._closed = True
            self.backend.close()
