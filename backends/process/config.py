"""Options of the ``process`` backend."""

from __future__ import annotations

from typing import Any

import msgspec

from hicache_storage.kit.options import check_count, check_seconds
from hicache_storage.redact import redacted_repr

__all__ = ["MAX_THREADS", "ProcessConfig"]

MAX_THREADS = 1024
"""Most calls the storage process serves at once: one per engine thread that calls storage
(query, read and write threads, a handful each), so a thousand is far past any real use."""


class ProcessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the process backend.

    Attributes
    ----------
    backend
        The registered backend to run in the storage process (not ``process`` itself).
    options
        That backend's own options, validated here before the process starts. Their secrets
        (passwords, tokens, URL passwords) never show in ``repr``.
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
            raise ValueError("the process backend cannot serve another process backend")
        check_count("threads", self.threads, maximum=MAX_THREADS)
        check_seconds("start_timeout_s", self.start_timeout_s)
        check_seconds("call_timeout_s", self.call_timeout_s)

    def __repr__(self) -> str:
        return redacted_repr(self)
