"""Dictionary backends with one bug each (the first teeth: truncation, prefix counting, ...)."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import msgspec
from typing_extensions import Buffer

from hicache_storage import BackendUnavailableError, Capabilities, Deployment
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.buffers import as_readable

from . import Bug, bug

__all__ = [
    "BUGS",
    "BrokenConfig",
    "DictBackend",
    "FoldsLongKeys",
    "HangsWhenDown",
    "IgnoresOut",
    "Leaks",
    "NonAtomic",
    "TotalNotPrefix",
    "Truncates",
    "Zombie",
]

# One dictionary per store name, shared by every instance that names it (what "reopen" opens).
_STORES: dict[str, dict[str, bytes]] = {}
_STORES_LOCK = threading.Lock()


class BrokenConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of every broken backend.

    Attributes
    ----------
    store
        Name of an in-process store shared by instances that name it; empty gives each instance
        a private one.
    """

    store: str = ""


class DictBackend(MemoryBackend):
    """The correct reference backend, optionally over a named shared store; subclasses break it."""

    name = "broken-base"
    capabilities = Capabilities(delete=True)

    def __init__(
        self, config: BrokenConfig | None = None, deployment: Deployment | None = None
    ) -> None:
        super().__init__()
        store = (config or BrokenConfig()).store
        if store:
            with _STORES_LOCK:
                self._data = _STORES.setdefault(store, {})

    def _lookup(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def _close(self) -> None:
        """Keep the data: a named store outlives its instances (persistence across reopen)."""


class Truncates(DictBackend):
    """Bug: values over 64 KiB lose their tail."""

    name = "broken-truncate"
    LIMIT: ClassVar[int] = 64 * 1024

    def set(self, key: str, value: Buffer) -> bool:
        return super().set(key, bytes(as_readable(value))[: self.LIMIT])


class FoldsLongKeys(DictBackend):
    """Bug: keys are cut to their first 120 characters (as stores with a short key limit do)."""

    name = "broken-folds-keys"
    LIMIT: ClassVar[int] = 120

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        return super().get(key[: self.LIMIT], out)

    def exists(self, key: str) -> bool:
        return super().exists(key[: self.LIMIT])

    def set(self, key: str, value: Buffer) -> bool:
        return super().set(key[: self.LIMIT], value)

    def delete(self, key: str) -> bool:
        return super().delete(key[: self.LIMIT])


class TotalNotPrefix(DictBackend):
    """Bug: ``batch_exists`` counts every hit instead of the leading run."""

    name = "broken-prefix"

    def batch_exists(self, keys: Any) -> int:
        return sum(self.exists(key) for key in keys)


class IgnoresOut(DictBackend):
    """Bug: ``get(key, out)`` returns the value but never writes it into ``out``."""

    name = "broken-ignores-out"

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        return self._lookup(key)


class NonAtomic(DictBackend):
    """Bug: ``set`` publishes the entry at once and fills it in chunks: readers see partial data."""

    name = "broken-nonatomic"
    CHUNKS: ClassVar[int] = 8

    def set(self, key: str, value: Buffer) -> bool:
        data = bytes(as_readable(value))
        with self._lock:
            if key in self._data:
                return True
            self._data[key] = b""
        step = max(1, -(-len(data) // self.CHUNKS))
        for end in range(step, len(data) + step, step):
            with self._lock:
                self._data[key] = data[:end]
            time.sleep(0.001)
        return True


class Zombie(DictBackend):
    """Bug: ``delete`` says it removed the key, but the key keeps being served."""

    name = "broken-zombie"

    def delete(self, key: str) -> bool:
        return self.exists(key)


class Leaks(DictBackend):
    """Bug: every call starts a thread that outlives ``close()``."""

    name = "broken-thread-leak"

    def _spawn(self) -> None:
        threading.Thread(target=time.sleep, args=(60,), daemon=True, name="broken-leak").start()

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        self._spawn()
        return super().get(key, out)

    def exists(self, key: str) -> bool:
        self._spawn()
        return super().exists(key)

    def set(self, key: str, value: Buffer) -> bool:
        self._spawn()
        return super().set(key, value)


class HangsWhenDown(DictBackend):
    """Bug: while its server is stopped, every call blocks for 30 s instead of failing fast.

    The "server" is a process-wide flag the suite flips through :mod:`.plugin`'s server-control
    hook; a correct backend would raise ``BackendUnavailableError`` at once.
    """

    name = "broken-hang"
    HANG_S: ClassVar[float] = 30.0
    server_up: ClassVar[threading.Event] = threading.Event()

    def _call(self) -> None:
        # Wait for the server to come back, up to HANG_S; only then admit it is down.
        if not self.server_up.is_set() and not self.server_up.wait(self.HANG_S):
            raise BackendUnavailableError("broken-hang: server is down")

    def get(self, key: str, out: Buffer | None = None) -> Buffer | None:
        self._call()
        return super().get(key, out)

    def exists(self, key: str) -> bool:
        self._call()
        return super().exists(key)

    def set(self, key: str, value: Buffer) -> bool:
        self._call()
        return super().set(key, value)


HangsWhenDown.server_up.set()


_M = __name__
BUGS: list[Bug] = [
    bug(
        "broken-truncate",
        f"{_M}:Truncates",
        "truncates values over 64 KiB",
        "TestRoundTrip::test_roundtrip_get_matches_sha256",
    ),
    bug(
        "broken-folds-keys",
        f"{_M}:FoldsLongKeys",
        "cuts keys to 120 characters, so keys of two object formats collide",
        "TestObjectFormats::test_tagged_keys_of_other_formats_are_misses",
    ),
    bug(
        "broken-prefix",
        f"{_M}:TotalNotPrefix",
        "batch_exists counts every hit",
        "TestPrefix::test_batch_exists_stops_at_gap",
    ),
    bug(
        "broken-ignores-out",
        f"{_M}:IgnoresOut",
        "get(key, out) leaves out untouched",
        "TestRoundTrip::test_roundtrip_get_into_out_matches_sha256",
    ),
    bug(
        "broken-nonatomic",
        f"{_M}:NonAtomic",
        "set publishes before the value is whole",
        "TestConcurrency::test_reader_racing_writer_sees_none_or_whole",
    ),
    bug(
        "broken-zombie",
        f"{_M}:Zombie",
        "delete says yes but the key stays",
        "TestDelete::test_delete_existing_removes_key",
    ),
    bug(
        "broken-thread-leak",
        f"{_M}:Leaks",
        "every call starts a thread that outlives close()",
        "TestLifecycle::test_no_thread_leak_after_open_use_close",
    ),
    bug(
        "broken-hang",
        f"{_M}:HangsWhenDown",
        "blocks 30 s per call while its server is down",
        "TestServerFaults::test_server_down_calls_miss_within_timeout",
    ),
]
