"""A directory's record of what its objects' bytes mean, for namings whose keys cannot say it.

Keys of the rank-suffix scheme end in the :class:`~hicache_storage.keys.format.ObjectFormat`
tag, so writers of different models, dtypes, geometries or layouts never share a key. A store
laid out as another system lays it out (the file backend's ``sglang_file_compat`` naming, whose
names are SGLang's ``HiCacheFile``'s) keeps SGLang's keys, which carry only the model name and the
ranks. :class:`FormatManifest` closes that gap: the first instance that registers a host pool
publishes the pool's format for its key suffix in ``.hicache-format<suffix>.json`` (first writer
wins, atomically), and every later instance whose pool's format differs is refused at
registration with a :class:`~hicache_storage.errors.ConfigError` instead of reading foreign bytes
as hits, as long as objects under that suffix remain (once none is left, the new format takes
the manifest over). The manifest's name starts with a dot, so no key can name it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import msgspec

from hicache_storage.errors import BackendIOError, ConfigError
from hicache_storage.keys.format import ObjectFormat

from .files import temp_name

__all__ = ["MANIFEST_PREFIX", "FormatManifest"]

MANIFEST_PREFIX = ".hicache-format"
"""Start of every manifest's file name; the rest is the key suffix and ``.json``."""


class FormatManifest:
    """The object format published for each key suffix in one directory.

    Parameters
    ----------
    directory
        Where the objects live (the manifests sit beside them).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path(self, suffix: str) -> str:
        """Return the path of the manifest of the objects whose keys end in ``suffix``."""
        return os.path.join(self.directory, f"{MANIFEST_PREFIX}{suffix}.json")

    def claim(self, suffix: str, fmt: ObjectFormat, occupied: Callable[[], bool]) -> None:
        """Publish ``fmt`` for ``suffix`` unless one is published; refuse any other format.

        ``occupied`` answers whether any object under ``suffix`` is stored: a manifest of
        another format over no object is replaced instead of refused.

        Raises
        ------
        ConfigError
            If the directory holds objects of another format under ``suffix``, or its manifest
            is not one this version can read.
        BackendIOError
            If the manifest cannot be written or read.
        """
        path = self.path(suffix)
        temp = os.path.join(self.directory, temp_name(os.path.basename(path).lstrip(".")))
        try:
            with open(temp, "xb") as handle:
                handle.write(msgspec.json.encode(fmt))
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
            with open(path, "rb") as handle:
                raw = handle.read()
        except OSError as exc:
            raise BackendIOError(f"object format manifest {path!r}: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        try:
            stored = msgspec.json.decode(raw, type=ObjectFormat)
        except (msgspec.DecodeError, ConfigError) as exc:
            raise ConfigError(
                f"{path!r} is not an object format manifest this version reads ({exc}); the "
                "objects beside it cannot be trusted: use another directory"
            ) from None
        if stored != fmt and not occupied():
            self._replace(path, fmt)
        elif stored != fmt:
            raise ConfigError(
                f"{self.directory!r} holds objects of {stored.describe()} under the key suffix "
                f"{suffix!r}; this host pool's pages are {fmt.describe()}. Their bytes mean "
                "different things under the same names: use another directory (or model name) "
                f"for this deployment, or remove the old objects and {path!r}"
            )

    def _replace(self, path: str, fmt: ObjectFormat) -> None:
        temp = os.path.join(self.directory, temp_name(os.path.basename(path).lstrip(".")))
        try:
            with open(temp, "xb") as handle:
                handle.write(msgspec.json.encode(fmt))
            os.replace(temp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise BackendIOError(f"object format manifest {path!r}: {exc}") from exc
