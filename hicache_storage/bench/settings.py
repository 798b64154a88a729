"""Settings of a nested config named by dotted path (``write.policy``), each checked by its type.

A benchmark's config is a frozen dataclass whose groups are frozen dataclasses too
(:class:`~hicache_storage.bench.engine.BenchConfig`: its workload, its engine, the cache's own
:class:`~hicache_storage.engine.cache.CacheConfig`). :func:`apply_settings` returns a copy with
some fields changed, each named by its path (``workload.clients``) or given in nested mappings
(``{"workload": {"clients": 4}}``). The paths are the dataclasses' own fields, so a field added to
a group can be set with no change here. Each value is converted to its field's type with msgspec
(a list becomes a tuple, a mapping a record), and every group changed is rebuilt once with all
of its changes, so that its checks see the final values together (a page size and the pool sizes
that must be whole pages of it). A wrong path names the fields there; a wrong value names its
path; both are one :class:`~hicache_storage.errors.ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import msgspec

from hicache_storage.errors import ConfigError
from hicache_storage.redact import redact_text, secrets_in

__all__ = ["apply_settings", "setting_names"]

T = TypeVar("T")


class _Changes(dict[str, Any]):
    """The changes to one group, by field name: values, or the changes to a nested group.

    ``base`` is a whole value given for the group before them, which they change in turn.
    """

    base: Any = None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _group(hint: Any) -> type | None:
    """Return ``hint`` if it is a dataclass (a group whose fields have paths of their own)."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _names(cls: type) -> list[str]:
    """Return ``cls``'s fields as paths name them: a group's with ``.*``."""
    hints = _hints(cls)
    return [f.name + (".*" if _group(hints[f.name]) else "") for f in dataclasses.fields(cls)]


def setting_names(cls: type, *, inline: str | None = None) -> str:
    """Return the settings of ``cls`` for a message or a help text: its fields, groups as ``x.*``.

    ``inline`` names a group whose fields may go without its name (see :func:`apply_settings`).
    """
    names = ", ".join(_names(cls))
    if inline is None:
        return names
    inner = ", ".join(_names(_hints(cls)[inline]))
    return f"{names}; and {inline}'s {inner} without '{inline}.'"


def apply_settings(
    config: T,
    settings: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    inline: str | None = None,
) -> T:
    """Return ``config`` with ``settings`` applied, in order (a later one wins).

    Parameters
    ----------
    config
        A dataclass whose groups are dataclass fields.
    settings
        Values by dotted path (``"write.policy"``), as a mapping or (path, value) pairs, or
        nested mappings of them; a mapping given for a group changes the fields it names, any
        other value replaces the field whole.
    inline
        A group of ``config`` whose own fields may be named without its name: with
        ``inline="cache"``, ``write.policy`` is ``cache.write.policy``.

    Raises
    ------
    ConfigError
        If a path names no field (the message lists the fields there), a value does not convert
        to its field's type, or a changed group refuses its new values.
    """
    root = _Changes()
    pairs = settings.items() if isinstance(settings, Mapping) else settings
    for key, value in pairs:
        _merge(type(config), root, key.split("."), value, "", inline)
    return _apply(config, root, "", inline)


def _merge(
    cls: type, changes: _Changes, path: list[str], value: Any, prefix: str, inline: str | None
) -> None:
    """Record ``value`` at ``path`` (under group ``cls``, shown as ``prefix``) in ``changes``."""
    head, *rest = path
    hints = _hints(cls)
    if head not in hints:
        if inline is not None and head in _hints(hints[inline]):
            _merge(hints[inline], _nested(changes, inline), path, value, prefix, None)
            return
        where = f"'{prefix[:-1]}' has" if prefix else "the settings are"
        names = setting_names(cls, inline=inline)
        raise ConfigError(f"unknown setting {prefix + '.'.join(path)!r}: {where} {names}")
    group = _group(hints[head])
    if group is None:
        if rest:
            raise ConfigError(
                f"unknown setting {prefix + '.'.join(path)!r}: {prefix + head!r} has no fields"
            )
        changes[head] = value
        return
    if not rest and not isinstance(value, Mapping):
        changes[head] = value
        return
    nested = _nested(changes, head)
    items = [(rest, value)] if rest else [(key.split("."), item) for key, item in value.items()]
    for sub_path, item in items:
        _merge(group, nested, sub_path, item, f"{prefix}{head}.", None)


def _nested(changes: _Changes, name: str) -> _Changes:
    """Return the changes to group ``name``, made on a whole value given for it before."""
    nested = changes.get(name)
    if not isinstance(nested, _Changes):
        earlier, nested = nested, _Changes()
        nested.base = earlier
        changes[name] = nested
    return nested


def _apply(record: T, changes: _Changes, prefix: str, inline: str | None = None) -> T:
    """Return ``record`` rebuilt once with ``changes`` (nested groups rebuilt first).

    Paths in messages start at ``prefix``; the ``inline`` group's fields go without its name.
    """
    kind: type = type(record)
    hints = _hints(kind)
    updates = {}
    for name, change in changes.items():
        path = prefix + name
        if isinstance(change, _Changes):
            base = change.base
            base = getattr(record, name) if base is None else _convert(base, hints[name], path)
            updates[name] = _apply(base, change, "" if name == inline else f"{path}.")
        else:
            updates[name] = _convert(change, hints[name], path)
    return dataclasses.replace(record, **updates)  # type: ignore[type-var]


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Return ``value`` as a ``hint``; a mismatch is a one-line ConfigError naming ``path``."""
    try:
        return msgspec.convert(value, hint)
    except msgspec.ValidationError as exc:
        message = f"setting {path}={value!r}: {exc}"
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            message += f" (one of {', '.join(str(member.value) for member in hint)})"
        raise ConfigError(redact_text(message, secrets_in(value))) from None
