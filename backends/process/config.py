"""Options of the ``process`` backend."""

from __future__ import annotations

from typing import Any

import msgspec

from hicache_storage.errors import ConfigError

__all__ = ["ProcessConfig"]


class ProcessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the process backend.

    Attributes
    ----------
    backend
        The registered backend to run in the storage process (not ``process`` itself).
    options
        That backend's own options, validated here before the process starts.
    threads
        Calls the storage process serves at once (the engine's query, read and write threads).
    start_timeout_s
        How long the storage process may take to start and build its backend.
    call_timeout_s
        How long one call may go unanswered before it fails as a timeout.
    """

    backend: str
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    threads: int = 8
    start_timeout_s: float = 120.0
    call_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backend == "process":
            raise ConfigError("the process backend cannot serve another process backend")
        if isinstance(self.threads, bool) or self.threads < 1:
            raise ConfigError(f"threads must be a positive int, got {self.threads!r}")
        for name in ("start_timeout_s", "call_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
