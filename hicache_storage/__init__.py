"""hicache-storage: the pluggable, conformance-tested storage tier (L3) of hierarchical KV caches.

The folders ``backends/``, ``conformance/`` and ``kernels/`` install as
``hicache_storage.backends``, ``hicache_storage.conformance`` and ``hicache_storage.kernels``.
"""

from __future__ import annotations

from typing import Any

from .backend import HostPool, StorageBackend
from .capabilities import Capabilities
from .config import Deployment, FaultConfig, FaultRule, HiCacheConfig, LayerConfig, load_config
from .errors import (
    AllocatorError,
    BackendClosedError,
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    BatchMismatchError,
    BufferSizeError,
    ConfigError,
    HiCacheError,
    HostPoolError,
    IndexAlignmentError,
    InjectedFaultError,
    IntegrityError,
    InvalidKeyError,
    InvalidValueError,
    MissingDependencyError,
    PoolNotRegisteredError,
    UnknownBackendError,
    UnsupportedOperationError,
)
from .factory import apply_layers, create_backend, open_backend
from .registry import (
    BackendSpec,
    get_spec,
    hookimpl,
    register_plugin,
    registered_backends,
    unregister_plugin,
)

__all__ = [
    "AllocatorError",
    "BackendClosedError",
    "BackendError",
    "BackendIOError",
    "BackendSpec",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BatchMismatchError",
    "BufferSizeError",
    "Capabilities",
    "ConfigError",
    "Deployment",
    "FaultConfig",
    "FaultRule",
    "HiCacheConfig",
    "HiCacheError",
    "HostPool",
    "HostPoolError",
    "IndexAlignmentError",
    "InjectedFaultError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidValueError",
    "LayerConfig",
    "MissingDependencyError",
    "PoolNotRegisteredError",
    "StorageBackend",
    "UnknownBackendError",
    "UnsupportedOperationError",
    "__version__",
    "apply_layers",
    "create_backend",
    "get_spec",
    "hookimpl",
    "load_config",
    "open_backend",
    "register_plugin",
    "registered_backends",
    "unregister_plugin",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("hicache-storage")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
