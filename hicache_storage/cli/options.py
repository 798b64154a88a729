"""Inputs and outputs of ``hicache check`` and ``hicache bench``, checked before any work runs.

A backend is a name or a URL (:mod:`hicache_storage.urls`); backend options are validated, and
scratch by default; output files and report directories are tried for writing up front, so a
mistake exits 2 at once instead of after a long run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import msgspec

from ..config import convert, read_source
from ..errors import ConfigError
from ..registry import get_spec
from ..urls import is_url, parse_backend_url

__all__ = [
    "CONFIG_HELP",
    "backend_options",
    "report_directory",
    "resolve_backend",
    "writable_file",
]

CONFIG_HELP = (
    "The backend's options as JSON, or @path to a JSON, YAML (.yaml/.yml) or TOML (.toml) file. "
    "With a BACKEND URL, these keys win over the options the URL gives."
)
"""The help of ``--config`` for ``hicache check`` and ``hicache bench``."""


def resolve_backend(backend: str, config: str | None) -> tuple[str, str | None]:
    """Return the backend name and the config source that BACKEND and ``--config`` mean.

    A name comes back as given, with ``config``. A URL (``redis://...``, see
    :func:`~hicache_storage.urls.parse_backend_url`) gives its backend's name and one JSON
    source: the URL's options updated with the keys of ``config``, whose keys win.

    Raises
    ------
    ConfigError
        If no backend claims the URL's scheme, the URL does not read as its scheme requires, or
        ``config`` cannot be read.
    """
    if not is_url(backend):
        return backend, config
    name, options = parse_backend_url(backend)
    options.update(read_source(config))
    return name, msgspec.json.encode(options).decode()


@contextlib.contextmanager
def backend_options(backend: str, config: str | None, prefix: str) -> Iterator[str | None]:
    """Yield the config source to run ``backend`` with, validated so mistakes exit 2 at once.

    Without ``config``, a backend whose options require a ``root`` directory or a ``path`` gets
    one in a fresh temporary directory (named ``prefix...``), removed afterwards.
    """
    spec = get_spec(backend)
    schema = spec.load_config_type()
    what = f"{backend} backend options"
    if config is not None:
        convert(read_source(config), schema, what)
        yield config
        return
    if not spec.scratch_options(""):
        yield None
        return
    scratch = tempfile.mkdtemp(prefix=prefix)
    try:
        options = spec.scratch_options(scratch)
        source = msgspec.json.encode(options).decode()
        convert(read_source(source), schema, what)
        yield source
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def writable_file(path: str, option: str) -> None:
    """Refuse ``path`` (the value of ``option``) unless a file can be written there.

    The file is opened for appending, which creates it without touching an existing one's
    bytes, and removed again if it did not exist.

    Raises
    ------
    ConfigError
        If the file cannot be opened for writing (no such directory, not a directory,
        permission denied, a directory of that name ...).
    """
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {path!r}: cannot write there: {exc.strerror}") from None
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(path)


def report_directory(path: str, option: str = "--report") -> None:
    """Create the report directory ``path`` and check that files can be written into it.

    Raises
    ------
    ConfigError
        If it cannot be created (a regular file on the way, permission denied ...) or holds
        no new file.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{option} {path!r}: cannot write a report there: {exc.strerror or exc}"
        ) from None
