"""One write of a key at a time through a process's chains, so every tier keeps one value.

Each tier keeps the first value written under a key. Two writers of one key that reach the
tiers in different orders (one wins the first tier, the other a later tier written beside it)
would leave the tiers holding different values, and a reader's answer would depend on which
tier served it. A writer therefore takes its keys' turns before writing them: a key another
writer is writing waits until that writer is done, then goes through every tier, where each
tier keeps the value the first writer left. Keys nobody else is writing go at once, so writers
of different keys never wait for each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["KeyTurns"]

T = TypeVar("T")


class KeyTurns:
    """Registry of the keys being written; :meth:`write` runs a batch in its keys' turns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writing: dict[str, threading.Event] = {}

    def write(self, keys: Sequence[str], write: Callable[[list[int]], list[bool]]) -> list[bool]:
        """Call ``write(positions)`` for the positions of ``keys`` whose turn it is, until done.

        A round writes the keys nobody else is writing (taking them first); the rest wait for
        the writers holding them, after this round's keys were given back, so two batches that
        hold each other's keys never wait for each other at once.
        """
        results = [False] * len(keys)
        left = list(range(len(keys)))
        while left:
            mine: list[int] = []
            theirs: list[threading.Event] = []
            later: list[int] = []
            taken: dict[str, threading.Event] = {}
            with self._lock:
                for position in left:
                    key = keys[position]
                    busy = self._writing.get(key)
                    if busy is not None:
                        theirs.append(busy)
                        later.append(position)
                    elif key in taken:
                        later.append(position)  # the same key twice in one batch: next round
                    else:
                        taken[key] = self._writing[key] = threading.Event()
                        mine.append(position)
            try:
                if mine:
                    for position, ok in zip(mine, write(mine), strict=True):
                        results[position] = ok
            finally:
                with self._lock:
                    for key, done in taken.items():
                        del self._writing[key]
                        done.set()
            for busy in theirs:
                busy.wait()
            left = later
        return results
