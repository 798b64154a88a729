"""Admission: which pages are worth writing to storage at all.

Writing a page costs the store's bandwidth and the host room it is pinned in; it pays only if the
page is read again. Two policies, values that can be swapped:

- :class:`AdmitAll`: every page offered (SGLang's ``write_through``);
- :class:`AdmitSeen`: a page once its key was looked up ``times`` times (the frequency admission
  of SGLang's ``write_through_selective`` and of Dynamo's KVBM): a prefix asked for twice is
  reused, one asked for once may never be. The counts live in a bounded table that forgets the
  least recently counted key first, so memory stays bounded however many keys pass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from hicache_storage.errors import ConfigError

__all__ = ["AdmitAll", "AdmitSeen", "Admission"]


class Admission(Protocol):
    """Decides per key whether a page is worth writing."""

    name: str

    def seen(self, keys: Iterable[str]) -> None:
        """Count a lookup of each of ``keys``."""

    def admit(self, keys: Sequence[str]) -> list[bool]:
        """Return, per key, whether its page is worth writing."""


class AdmitAll:
    """Every page is worth writing."""

    name = "all"

    def seen(self, keys: Iterable[str]) -> None:
        """Nothing to count."""

    def admit(self, keys: Sequence[str]) -> list[bool]:
        """Admit every key."""
        return [True] * len(keys)


class AdmitSeen:
    """A page is worth writing once its key was looked up ``times`` times.

    Parameters
    ----------
    times
        Lookups before a key's page is written (1 admits every key looked up once).
    capacity
        Keys whose counts are kept; the least recently counted is forgotten first.
    """

    name = "seen"

    def __init__(self, times: int = 2, *, capacity: int = 1 << 20) -> None:
        for label, value in (("times", times), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be a positive int, got {value!r}")
        self.times = times
        self.capacity = capacity
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, keys: Iterable[str]) -> None:
        """Count a lookup of each key, forgetting the least recently counted beyond capacity."""
        with self._lock:
            for key in keys:
                self._counts[key] = self._counts.get(key, 0) + 1
                self._counts.move_to_end(key)
            while len(self._counts) > self.capacity:
                self._counts.popitem(last=False)

    def admit(self, keys: Sequence[str]) -> list[bool]:
        """Admit the keys looked up at least ``times`` times."""
        with self._lock:
            return [self._counts.get(key, 0) >= self.times for key in keys]
