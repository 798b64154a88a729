"""What a backend promises: the record the conformance suite reads to choose its checks."""

from __future__ import annotations

import dataclasses

__all__ = ["Capabilities"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """Declared abilities of a backend.

    Every flag defaults to the weakest promise, so a backend claims only what it proves.

    Attributes
    ----------
    persistent
        Data survives ``close()`` and a new instance over the same store sees it.
    shared
        Several processes may use one store at once and see each other's writes.
    native_zero_copy
        ``batch_get_v1``/``batch_set_v1`` move pages straight between the store and the host
        pool's memory, without the generic bounce through ``get``/``set``.
    bounded
        Usage stays under a configured capacity by evicting old objects.
    delete
        ``delete(key)`` removes an object.
    ttl
        Objects expire after a configured time.
    crash_safe_writes
        A writer killed during ``set`` leaves the key absent or holding its old complete value.
    max_value_size
        The largest value in bytes the backend accepts, or ``None`` for no limit.
    """

    persistent: bool = False
    shared: bool = False
    native_zero_copy: bool = False
    bounded: bool = False
    delete: bool = False
    ttl: bool = False
    crash_safe_writes: bool = False
    max_value_size: int | None = None

    def claimed(self) -> list[str]:
        """Return the names of the boolean capabilities this record claims, in field order."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.type in ("bool", bool) and getattr(self, f.name)
        ]
