"""The raw-disk yardstick the benchmark compares the file backend with.

It writes and reads the same bytes to the same disk with nothing on top: one plain
``open(..., "wb").write()`` per value (plus ``fsync`` when the backend is configured with it) and
one ``open(..., "rb").readinto()`` per read (looping on short reads), in a flat
``<root>/.raw-baseline/`` directory. No temporary file, no atomic publish, no index, no fan-out:
the gap between the two is the cost of the backend's guarantees.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence

from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import BatchMismatchError, BufferSizeError
from hicache_storage.keys.validation import validate_key

from .backend import BASELINE_DIR
from .config import FileConfig

__all__ = ["RawDiskBaseline"]


class RawDiskBaseline:
    """Plain file writes and reads under ``<root>/.raw-baseline/``.

    Parameters
    ----------
    config
        The file backend's settings: ``root`` and ``fsync`` are used.
    deployment
        Unused; accepted so that every baseline is built like its backend.
    """

    def __init__(self, config: FileConfig, deployment: Deployment | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(config.root))
        self.directory = os.path.join(root, BASELINE_DIR)
        self.fsync = config.fsync
        os.makedirs(self.directory, exist_ok=True)

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Write each value to its own file, replacing any earlier one."""
        _check_lengths(names, values)
        for name, value in zip(names, values, strict=True):
            data = as_readable(value)
            with open(self._path(name), "wb", buffering=0) as f:
                written = 0
                while written < data.nbytes:
                    n = f.write(data[written:])
                    if not n:
                        raise OSError(errno.EIO, f"baseline write of {name!r} made no progress")
                    written += n
                if self.fsync:
                    os.fsync(f.fileno())

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Read each file into its output buffer.

        Raises
        ------
        BufferSizeError
            If a file is shorter than its output buffer.
        """
        _check_lengths(names, outs)
        for name, out in zip(names, outs, strict=True):
            view = as_writable(out)
            with open(self._path(name), "rb", buffering=0) as f:
                got = 0
                while got < view.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
                if got != view.nbytes:
                    raise BufferSizeError(
                        f"baseline file {name!r} holds {got} bytes, not {view.nbytes}"
                    )

    def close(self) -> None:
        """Remove the baseline's scratch directory."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, validate_key(name))


def _check_lengths(names: Sequence[str], buffers: Sequence[memoryview]) -> None:
    if len(names) != len(buffers):
        raise BatchMismatchError(f"got {len(names)} names but {len(buffers)} buffers")
