"""Typed configuration: deployment facts, layer settings and each backend's own options.

A config comes from a mapping, a JSON string, a file (``"@path"``: JSON, or YAML or TOML by its
suffix) or a msgspec Struct, and environment variables override it: ``HICACHE_BACKEND=file``,
``HICACHE_DEPLOYMENT__TP_RANK=1``, ``HICACHE_OPTIONS__ROOT=/data/kv``,
``HICACHE_LAYERS__FAULTS__DEFAULT__FAILURE_RATE=0.1`` (``__`` descends one level; values are read
as JSON when they parse, else as strings). Unknown keys and wrong types raise
:class:`~hicache_storage.errors.ConfigError` naming the offending path.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import msgspec.inspect
import msgspec.toml
import msgspec.yaml

from .errors import ConfigError
from .keys import KeyScheme, KeySchemeError, RankSuffixScheme, UnifiedPlan, plan_unified
from .kit.options import MAX_TIMEOUT_S, check_count, check_seconds
from .redact import redact_text, redacted_repr, secrets_in
from .registry import PLUGINS_ENV, registered_backends

__all__ = [
    "BUILT_IN_LAYERS",
    "ENV_PREFIX",
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "OPERATIONS",
    "RESERVED_ENV",
    "Deployment",
    "FaultConfig",
    "FaultRule",
    "HealthConfig",
    "HiCacheConfig",
    "LayerConfig",
    "QuotaConfig",
    "UnifiedKeys",
    "check_duration",
    "convert",
    "env_overrides",
    "load_config",
    "read_source",
    "require_backend",
]

ENV_PREFIX = "HICACHE_"
RESERVED_ENV = frozenset({"HICACHE_CONFIG", "HICACHE_SERVICES", PLUGINS_ENV})
"""``HICACHE_*`` names that are not config overrides: the config source, the test services and
the plugin modules to load (:data:`~hicache_storage.registry.PLUGINS_ENV`)."""

OPERATIONS = (
    "get",
    "exists",
    "set",
    "delete",
    "batch_get",
    "batch_set",
    "batch_exists",
    "batch_get_v1",
    "batch_set_v1",
)

T = TypeVar("T")


class _Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config record: immutable, keyword-only, unknown fields refused."""


class UnifiedKeys(_Config, frozen=True):
    """What the unified key scheme needs to know beyond the rank's position (``docs/keys.md``).

    Attributes
    ----------
    dtype
        Logical KV element type (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``, ...).
    num_layers
        Layers of the whole model.
    model_id
        The model; empty takes :attr:`Deployment.model_name`.
    layer_start, layer_end
        Absolute layers this pipeline stage holds, ``[layer_start, layer_end)``; the end
        defaults to ``num_layers``.
    layer_partition
        Layers per object; every stage of every deployment sharing the store must start on
        this grid. Default ``num_layers``.
    local_kv_heads
        KV heads in this rank's host pool (MHA/GQA; leave 0 for MLA).
    total_kv_heads
        KV heads of the model; default ``local_kv_heads * tp_size``.
    head_group, tp_lcm_size
        The fleet's head grid, one of the two (MHA only): KV heads per object, or the lcm of
        every attention-TP size sharing the store.
    object_layout
        Byte order of the stored objects.
    """

    dtype: str
    num_layers: int
    model_id: str = ""
    layer_start: int = 0
    layer_end: int | None = None
    layer_partition: int | None = None
    local_kv_heads: int = 0
    total_kv_heads: int | None = None
    head_group: int | None = None
    tp_lcm_size: int | None = None
    object_layout: str = "page-unified-v1"


class Deployment(_Config, frozen=True):
    """Facts about the serving deployment a backend instance belongs to.

    Attributes
    ----------
    model_name
        Model identity; part of rank-suffix keys so different models never share objects.
    tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size
        Tensor-, pipeline- and context-parallel position of this rank.
    is_mla
        Whether KV is replicated on every TP rank (MLA): one object per page, one writer.
    page_size
        Tokens per KV page.
    key_scheme
        How keys are derived from page hashes: ``"rank_suffix"`` (default; one object per page
        and rank) or ``"unified"`` (objects named by what they hold; needs :attr:`unified`).
    unified
        The unified scheme's settings.
    """

    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_mla: bool = False
    page_size: int = 64
    key_scheme: Literal["rank_suffix", "unified"] = "rank_suffix"
    unified: UnifiedKeys | None = None

    def __post_init__(self) -> None:
        check_count("page_size", self.page_size)
        self.rank_suffix()
        if self.key_scheme == "unified":
            self.unified_plan()

    def rank_suffix(self) -> RankSuffixScheme:
        """Return this rank's rank-suffix key scheme (validates ranks against sizes).

        The scheme takes every fact of the rank it shares a name with (model, ranks and sizes,
        MLA), so a field added to both reaches the keys without being copied here.
        """
        return RankSuffixScheme(**{name: getattr(self, name) for name in _RANK_FACTS})

    def unified_plan(self) -> UnifiedPlan:
        """Return this rank's unified-scheme plan.

        Raises
        ------
        KeySchemeError
            If :attr:`unified` is unset or the rank's shard does not tile the grid.
        UnsupportedOperationError
            With context parallelism.
        """
        settings = self.unified
        if settings is None:
            raise KeySchemeError(
                "key_scheme 'unified' needs deployment.unified settings: at least dtype and "
                "num_layers, plus local_kv_heads and head_group or tp_lcm_size for MHA models"
            )
        end = settings.num_layers if settings.layer_end is None else settings.layer_end
        return plan_unified(
            model_id=settings.model_id or self.model_name,
            dtype=settings.dtype,
            page_size=self.page_size,
            num_layers=settings.num_layers,
            layer_range=(settings.layer_start, end),
            layer_partition=settings.layer_partition,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            local_kv_heads=settings.local_kv_heads,
            total_kv_heads=settings.total_kv_heads,
            head_group=settings.head_group,
            tp_lcm_size=settings.tp_lcm_size,
            is_mla=self.is_mla,
            cp_size=self.cp_size,
            object_layout=settings.object_layout,
        )

    def scheme(self) -> KeyScheme:
        """Return the key scheme this deployment uses (see :attr:`key_scheme`)."""
        return self.unified_plan() if self.key_scheme == "unified" else self.rank_suffix()


_RANK_FACTS = tuple(
    field.name
    for field in dataclasses.fields(RankSuffixScheme)
    if field.name in Deployment.__struct_fields__
)
"""The rank-suffix scheme's fields that a :class:`Deployment` states."""


class FaultRule(_Config, frozen=True):
    """Injected delay and failure probability for one operation.

    Attributes
    ----------
    failure_rate
        Probability in [0, 1] that a call (or, for batch calls, each key) fails.
    delay_s
        Seconds to sleep before every call.
    """

    failure_rate: float = 0.0
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be within [0, 1], got {self.failure_rate}")
        check_seconds("delay_s", self.delay_s, allow_zero=True)


class FaultConfig(_Config, frozen=True):
    """Fault injection for tests and chaos runs, seeded per thread.

    Attributes
    ----------
    seed
        Seed mixed with each thread's name, so runs repeat and threads diverge.
    default
        The rule for operations not listed in ``ops``.
    ops
        Per-operation rules, by operation name (``get``, ``batch_get_v1``, ...).
    """

    seed: int = 0
    default: FaultRule = FaultRule()
    ops: dict[str, FaultRule] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(OPERATIONS))
        if unknown:
            raise ValueError(
                f"unknown operations {unknown} in fault rules; known: {', '.join(OPERATIONS)}"
            )


class HealthConfig(_Config, frozen=True):
    """When the health layer probes a store it treats as down (``docs/layers.md``).

    Attributes
    ----------
    probe_interval_s
        Wait after the first failed probe (the first probe goes at once); it doubles after each
        failed probe.
    max_probe_interval_s
        Longest wait between probes.
    """

    probe_interval_s: float = 0.1
    max_probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        check_seconds("probe_interval_s", self.probe_interval_s)
        check_seconds("max_probe_interval_s", self.max_probe_interval_s)
        if self.max_probe_interval_s < self.probe_interval_s:
            raise ValueError(
                f"max_probe_interval_s={self.max_probe_interval_s:g} is shorter than "
                f"probe_interval_s={self.probe_interval_s:g}"
            )


class QuotaConfig(_Config, frozen=True):
    """A byte quota on one namespace of a shared store (``docs/layers.md``, "Quotas").

    Attributes
    ----------
    bytes
        The most bytes of values the namespace holds, counted across every process and machine
        writing into it through its shared ledger.
    low_watermark
        Fraction of ``bytes`` that an eviction frees down to, so evictions come in batches.
    ledger
        Where the namespace's ledger lives. None (the default) asks the backend for the one its
        store keeps (the file backend: an SQLite file in its root; Redis: keys beside the
        pages). Otherwise a path of an SQLite file on a file system every writer mounts, or a
        ``redis://`` URL (then ``namespace`` names the ledger there).
    namespace
        The namespace's account inside a shared ledger: required with a ``redis://`` one;
        tenants sharing one SQLite file each give their own (None there: the file's default).
    hold_s
        How long a write's claim on room counts once made: a process killed mid-write leaves
        a claim that nobody settles, forgotten this long after it was made. Every backend
        bounds a write by its deadline, a few seconds by default, far below it.
    """

    bytes: int
    low_watermark: float = 0.9
    ledger: str | None = None
    namespace: str | None = None
    hold_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes <= 0:
            raise ValueError(f"bytes must be a positive int, got {self.bytes!r}")
        low = self.low_watermark
        if isinstance(low, bool) or not isinstance(low, (int, float)) or not 0.0 < low < 1.0:
            raise ValueError(f"low_watermark must be a number within (0, 1), got {low!r}")
        check_seconds("hold_s", self.hold_s)
        redis_ledger = self.ledger is not None and self.ledger.startswith(("redis://", "rediss://"))
        if redis_ledger and not self.namespace:
            raise ValueError("a redis:// ledger needs namespace, the ledger's name there")
        if self.ledger == "":
            raise ValueError("ledger must name an SQLite file or a redis:// URL, or be null")


class LayerConfig(_Config, frozen=True):
    """Which layers wrap a backend built by :func:`~hicache_storage.create_backend`.

    Attributes
    ----------
    metrics
        Count operations and time them (readable through ``stats()``, exported to Prometheus).
    degrade
        Turn infrastructure errors into counted misses so storage never fails a request.
    health
        Once a call finds the store not answering (a timeout, no connection), answer every call
        at once as a miss and probe the store in the background until it answers; ``None``
        turns it off. It sheds calls as misses, so it applies only under ``degrade``.
    verify
        Check every page a v1 read answers as a hit against the integrity record its writer
        stored beside it (``hicache_storage.layers.verify``): a page whose bytes are not the
        ones written for its key is a counted miss, whatever the backend answered.
    faults
        Inject delays and failures (off unless set).
    quota
        Hold the namespace within a byte quota shared by every writer (off unless set): a
        write that would pass it first evicts the namespace's least recently used pages.
    stack
        The layers inside validation (always outermost), outermost first: ``"degrade"``,
        ``"health"`` (inside degrade, with ``health`` set), ``"metrics"``, ``"quota"`` (with
        ``quota`` set), ``"verify"``, ``"faults"`` (with ``faults`` set) and ``"module:Class"``
        for a layer of your own, a :class:`~hicache_storage.layers.ForwardingBackend` subclass
        called with the backend it wraps. None (the default) is today's order from the flags
        above: degrade, health, metrics, quota, verify, faults. With a stack, the flags stay at
        their defaults.
    """

    metrics: bool = True
    degrade: bool = True
    health: HealthConfig | None = HealthConfig()
    verify: bool = True
    faults: FaultConfig | None = None
    quota: QuotaConfig | None = None
    stack: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.stack is None:
            return
        if not (self.metrics and self.degrade):
            raise ValueError(
                "name the layers in stack instead of turning metrics or degrade off beside it"
            )
        seen: set[str] = set()
        for entry in self.stack:
            if entry not in BUILT_IN_LAYERS and not _LAYER_PATH.fullmatch(entry):
                raise ValueError(
                    f"unknown layer {entry!r} in stack: name one of "
                    f"{', '.join(BUILT_IN_LAYERS)} or a layer class as 'module:Class'"
                )
            if entry in seen:
                raise ValueError(f"layer {entry!r} appears twice in stack")
            seen.add(entry)
        if ("faults" in seen) != (self.faults is not None):
            raise ValueError("stack names 'faults' exactly when faults is set")
        if ("quota" in seen) != (self.quota is not None):
            raise ValueError("stack names 'quota' exactly when quota is set")
        if "health" in seen:
            if self.health is None:
                raise ValueError("stack names 'health' but health is off (null)")
            if "degrade" not in self.stack[: self.stack.index("health")]:
                raise ValueError(
                    "'health' answers misses for a store that does not answer: name it inside "
                    "(after) 'degrade' in stack"
                )

    def layer_stack(self) -> tuple[str, ...]:
        """Return the layers inside validation, outermost first (:attr:`stack` resolved)."""
        if self.stack is not None:
            return self.stack
        flags = {"degrade": self.degrade, "metrics": self.metrics}
        flags["health"] = self.degrade and self.health is not None
        flags["verify"] = self.verify
        flags["faults"] = self.faults is not None
        flags["quota"] = self.quota is not None
        return tuple(name for name in BUILT_IN_LAYERS if flags[name])


BUILT_IN_LAYERS = ("degrade", "health", "metrics", "quota", "verify", "faults")
"""The layers :attr:`LayerConfig.stack` names by word, in their default order."""

_LAYER_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class HiCacheConfig(_Config, frozen=True):
    """A whole configuration: which backend, its options, the deployment and the layers.

    Attributes
    ----------
    backend
        Registered backend name.
    options
        The backend's own settings, validated against its schema when it is built. Their
        secrets (passwords, tokens, URL passwords) never show in ``repr``.
    deployment
        Facts about this rank.
    layers
        Layer settings.
    strict_start
        Fail :func:`~hicache_storage.open_backend` (and so an engine's start-up) when the
        store cannot be reached. False (the default) starts without it: every call a counted
        miss while a background thread attaches it once it answers (``docs/layers.md``).
    """

    backend: str = "file"
    options: dict[str, Any] = {}
    deployment: Deployment = Deployment()
    layers: LayerConfig = LayerConfig()
    strict_start: bool = False

    def __repr__(self) -> str:
        return redacted_repr(self)


MAX_DEPTH = 32
"""Deepest nesting of objects and lists a config may have: real ones stay below ten, and a bound
keeps every walk over a config (merging, validating, masking secrets) far from Python's
recursion limit."""
MAX_INT_BITS = 64
"""Widest integer a config may hold: every integer option fits in 64 bits (msgspec's own bound)."""


def check_duration(
    name: str,
    value: object,
    *,
    maximum: float = MAX_TIMEOUT_S,
    allow_zero: bool = False,
    allow_none: bool = False,
) -> None:
    """Refuse a duration as every config of the project does, with a one-line ``ConfigError``.

    The one bound behind every ``*_s`` setting (:func:`~hicache_storage.kit.options.check_seconds`,
    which config Structs call from ``__post_init__``), for the dataclass configs that raise
    ``ConfigError`` themselves: a finite number of seconds, above zero (or zero where
    ``allow_zero``), at most ``maximum``. The default, an hour
    (:data:`~hicache_storage.kit.options.MAX_TIMEOUT_S`), is far past any useful wait on a
    cache and far below what a lock, a socket or ``time.sleep`` accepts
    (``threading.TIMEOUT_MAX``, a ``time_t``), so no accepted duration ends as a raw
    ``OverflowError`` later.

    Raises
    ------
    ConfigError
        Naming ``name``, for a non-number (``bool`` included), NaN, infinity or a value out of
        range.
    """
    try:
        check_seconds(name, value, maximum=maximum, allow_zero=allow_zero, allow_none=allow_none)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def read_source(source: Any) -> dict[str, Any]:
    """Read a config source into a plain mapping.

    A file (``"@path"`` or a :class:`~pathlib.Path`) is read by its suffix: ``.yaml`` or
    ``.yml`` as YAML (safe loading; needs PyYAML, ``pip install pyyaml``), ``.toml`` as TOML (the
    standard library's ``tomllib``, or ``tomli`` before Python 3.11), anything else as JSON. A
    file is UTF-8 (a byte-order mark allowed), or UTF-16 or UTF-32 as some editors save it;
    ``json.detect_encoding`` tells them apart. An empty YAML file is an empty config.

    Raises
    ------
    ConfigError
        If the JSON, YAML or TOML is malformed, nested deeper than :data:`MAX_DEPTH` or holds an
        integer wider than :data:`MAX_INT_BITS` bits, the file is missing or not text, the
        library a YAML or TOML file needs is not installed, or the top level is not an object.
    """
    if source is None:
        return {}
    kind = "JSON object"
    if isinstance(source, msgspec.Struct):
        data: Any = msgspec.to_builtins(source)
    elif isinstance(source, Mapping):
        data = dict(source)
    elif isinstance(source, Path) or (isinstance(source, str) and source.startswith("@")):
        path = Path(source[1:] if isinstance(source, str) else source)
        data, kind = _parse_file(path)
    elif isinstance(source, str):
        data = _parse_json(source, "config JSON") if source.strip() else {}
    else:
        raise ConfigError(
            f"a config must be a mapping, a JSON string or '@path', not {type(source).__name__}"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a {kind}, got {type(data).__name__}")
    _check_shape(data, "a config")
    return data


_YAML_SUFFIXES = (".yaml", ".yml")
"""Suffixes of config files read as YAML; ``.toml`` is TOML and any other suffix JSON."""

_MAX_YAML_VALUES = 100_000
"""Most values a YAML config may expand to: aliases (``*name``) can repeat a subtree so often that
a small file stands for billions of values; real configs hold a few hundred."""


def _parse_file(path: Path) -> tuple[Any, str]:
    """Return the content of config file ``path``, parsed by its suffix, and what its top is."""
    what = f"config file {str(path)!r}"
    suffix = path.suffix.lower()
    if suffix in _YAML_SUFFIXES:
        return _parse_yaml(_read_text(path), what), "YAML mapping"
    if suffix == ".toml":
        return _parse_toml(_read_text(path), what), "TOML table"
    return _parse_json(_read_text(path), what), "JSON object"


def _parse_yaml(text: str, what: str) -> Any:
    """Return YAML ``text`` safely loaded (PyYAML's safe loader): plain data, no Python objects."""
    try:
        data = msgspec.yaml.decode(text)
    except ImportError:
        raise ConfigError(
            f"{what} is YAML, which needs PyYAML; run: pip install pyyaml "
            "(or write the config as JSON or TOML)"
        ) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{what} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels") from None
    if data is None:  # empty, or only comments
        return {}
    _check_yaml_values(data, what)
    return data


def _check_yaml_values(data: Any, what: str) -> None:
    """Refuse YAML that expands to more than ``_MAX_YAML_VALUES`` values or has non-text keys.

    Depth is bounded before the count runs out, so the walk's stack stays small.
    """
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    count = 0
    while stack:
        value, path, depth = stack.pop()
        count += 1
        if count > _MAX_YAML_VALUES:
            raise ConfigError(
                f"{what} expands to more than {_MAX_YAML_VALUES} values (aliases repeating a "
                "subtree?)"
            )
        if depth > MAX_DEPTH + 1:
            raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, child in value.items():
                if not isinstance(key, str):
                    where = f" under {path.lstrip('.')}" if path else ""
                    raise ConfigError(
                        f"{what} has the key {key!r}{where}, which is not text; quote it"
                    )
                stack.append((child, f"{path}.{key}", depth + 1))
        elif isinstance(value, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(value))


def _parse_toml(text: str, what: str) -> Any:
    """Return TOML ``text`` parsed by ``tomllib`` (Python 3.11) or ``tomli``."""
    try:
        return msgspec.toml.decode(text)
    except ImportError:
        raise ConfigError(
            f"{what} is TOML, which needs Python 3.11 or tomli; run: pip install tomli "
            "(or write the config as JSON)"
        ) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{what} is not valid TOML: {exc}") from None


def _read_text(path: Path) -> str:
    """Return the text of config file ``path``, decoded as :func:`json.loads` would decode it."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not {encoding} text ({exc.reason} at byte "
            f"{exc.start}); save it as UTF-8"
        ) from None


def _loads(text: str, what: str) -> Any:
    """Return ``json.loads(text)``; JSON that parses to no config value raises ``ConfigError``.

    Malformed JSON still raises :class:`json.JSONDecodeError`, for the caller to judge.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # an integer of more digits than int() converts
        raise ConfigError(
            f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None


def _parse_json(text: str, what: str) -> Any:
    try:
        return _loads(text, what)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc}") from exc


def _check_shape(data: Any, what: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and integers wider than :data:`MAX_INT_BITS`.

    Iterative, so that a structure built in code (not parsed) cannot exhaust the stack either.
    """
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, Mapping):
            children: Any = [(child, f"{path}.{key}") for key, child in value.items()]
        elif isinstance(value, (list, tuple)):
            children = [(child, f"{path}[{i}]") for i, child in enumerate(value)]
        else:
            if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
                where = f" at {path.lstrip('.')}" if path else ""
                raise ConfigError(
                    f"{what} holds an integer of {value.bit_length()} bits{where}; integers "
                    f"of a config fit in {MAX_INT_BITS}"
                )
            continue
        if depth > MAX_DEPTH:
            raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1, where) for child, where in children)


def convert(data: Mapping[str, Any], type_: type[T], what: str) -> T:
    """Validate ``data`` into ``type_``.

    Raises
    ------
    ConfigError
        Naming ``what`` and msgspec's path to the offending field; secrets found in ``data``
        (passwords, tokens, URL passwords) are masked in the message. Also for nesting or
        integers out of bounds (see :func:`read_source`).
    """
    _check_shape(data, what)
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        message = redact_text(
            f"invalid {what}: {exc}{_suggest_field(str(exc), type_)}", secrets_in(data)
        )
        raise ConfigError(message) from None


_UNKNOWN_FIELD = re.compile(
    r"^Object contains unknown field `(?P<field>[^`]*)`(?: - at `(?P<path>.*)`)?$"
)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[[^\]]*\]")
_SEQUENCES = (msgspec.inspect.ListType, msgspec.inspect.VarTupleType, msgspec.inspect.SetType)


def _struct_at(type_: Any, path: str) -> msgspec.inspect.StructType | None:
    """Return the Struct that msgspec's error ``path`` (``$.a.b[...]``) points into, if any."""
    try:
        node: msgspec.inspect.Type = msgspec.inspect.type_info(type_)
    except (TypeError, ValueError):
        return None
    rest = path.removeprefix("$")
    while True:
        if isinstance(node, msgspec.inspect.UnionType):
            structs = [t for t in node.types if isinstance(t, msgspec.inspect.StructType)]
            containers = [
                t for t in node.types if isinstance(t, (msgspec.inspect.DictType, *_SEQUENCES))
            ]
            candidates = structs if rest.startswith(".") or not rest else containers
            if len(candidates) != 1:
                return None
            node = candidates[0]
            continue
        if not rest:
            return node if isinstance(node, msgspec.inspect.StructType) else None
        part = _PATH_PART.match(rest)
        if part is None:
            return None
        rest = rest[part.end() :]
        key = part.group(1)
        if key is not None and isinstance(node, msgspec.inspect.StructType):
            fields = [f.type for f in node.fields if f.encode_name == key]
            if not fields:
                return None
            node = fields[0]
        elif key is None and isinstance(node, msgspec.inspect.DictType):
            node = node.value_type
        elif key is None and isinstance(node, _SEQUENCES):
            node = node.item_type
        else:
            return None


def _suggest_field(error: str, type_: Any) -> str:
    """Name the closest valid field and list all, for an unknown-field ``error``; else ``""``."""
    unknown = _UNKNOWN_FIELD.match(error)
    if unknown is None:
        return ""
    struct = _struct_at(type_, unknown.group("path") or "$")
    if struct is None:
        return ""
    names = [field.encode_name for field in struct.fields]
    close = difflib.get_close_matches(unknown.group("field"), names, n=1)
    guess = f"; did you mean `{close[0]}`?" if close else ";"
    return f"{guess} valid fields: {', '.join(names) or 'none'}"


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """Collect ``HICACHE_*`` variables into a nested mapping (``__`` separates levels)."""
    nested: dict[str, Any] = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        what = f"environment variable {name}"
        try:
            value: Any = _loads(raw, what)
        except json.JSONDecodeError:
            value = raw
        _check_shape(value, what)
        node = nested
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name} conflicts with another")
            node = child
        node[path[-1]] = value
    return nested


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def require_backend(
    data: Mapping[str, Any], where: str, *, env: Mapping[str, str] | None = None
) -> None:
    """Refuse a config that names no backend where a default backend would be a guess.

    :class:`HiCacheConfig` defaults to ``file``; an integration entry that forgot ``backend``
    would then build a file backend and complain about its options (``url`` unknown), not about
    the key that is missing. ``HICACHE_BACKEND`` in ``env`` (default ``os.environ``) counts.

    Raises
    ------
    ConfigError
        Saying ``backend`` is required in ``where`` and listing the registered backends.
    """
    env = os.environ if env is None else env
    if "backend" in data or env.get(f"{ENV_PREFIX}BACKEND"):
        return
    raise ConfigError(
        f"{where} names no 'backend'; it is required: one of "
        f"{', '.join(registered_backends())} (or set {ENV_PREFIX}BACKEND)"
    )


def load_config(source: Any = None, *, env: Mapping[str, str] | None = None) -> HiCacheConfig:
    """Build a :class:`HiCacheConfig` from ``source`` overridden by the environment.

    ``source`` defaults to ``$HICACHE_CONFIG`` (JSON, or ``@path`` to a JSON, YAML or TOML file)
    when that is set.

    Raises
    ------
    ConfigError
        If any part is malformed, unknown or of the wrong type.
    """
    env = os.environ if env is None else env
    if source is None and env.get(f"{ENV_PREFIX}CONFIG"):
        source = env[f"{ENV_PREFIX}CONFIG"]
    data = _merge(read_source(source), env_overrides(env))
    return convert(data, HiCacheConfig, "hicache config")
