"""The raw fsspec yardstick the benchmark compares the fsspec backend with.

Plain filesystem calls on the same URL, with nothing on top: one ``pipe_file`` per value and one
``cat_file`` per read, copied into the caller's buffer, in a flat ``<root>/.raw-baseline/``
directory. No fan-out, no create-if-absent, no size check before the transfer, no deadline: the
gap between the two is the cost of the backend's guarantees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hicache_storage import BufferSizeError, Deployment
from hicache_storage.kit import flat

from .backend import open_filesystem
from .config import FsspecConfig

__all__ = ["FsspecBaseline"]


class FsspecBaseline:
    """Whole-value ``pipe_file``/``cat_file`` under ``<root>/.raw-baseline/``.

    Parameters
    ----------
    config
        The fsspec backend's settings: ``url`` and ``storage_options`` are used.
    deployment
        Unused; accepted so that every baseline is built like its backend.
    """

    def __init__(self, config: FsspecConfig, deployment: Deployment | None = None) -> None:
        self.fs, root = open_filesystem(config)
        self.directory = f"{root.rstrip('/')}/.raw-baseline"
        self.fs.makedirs(self.directory, exist_ok=True)

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Write each value whole under its name, replacing any earlier one."""
        for name, value in zip(names, values, strict=True):
            self.fs.pipe_file(f"{self.directory}/{name}", bytes(value))

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Read each named value into its buffer.

        Raises
        ------
        BufferSizeError
            If a value's size differs from its buffer's.
        """
        for name, out in zip(names, outs, strict=True):
            data = self.fs.cat_file(f"{self.directory}/{name}")
            if len(data) != out.nbytes:
                raise BufferSizeError(
                    f"baseline {name!r} holds {len(data)} bytes, not {out.nbytes}"
                )
            flat(out)[:] = data

    def close(self) -> None:
        """Remove the baseline's scratch directory."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.directory, recursive=True)
