"""The raw boto3 yardstick the benchmark compares the S3 backend with.

The same bytes go to the same bucket through a plain boto3 client built with the backend's own
client settings (timeouts, retries, connection pool, checksums), at the same concurrency: one
``put_object(Body=bytes)`` per value and ``out[:] = get_object()["Body"].read()`` per read, on a
thread pool of ``max_concurrency`` workers. No conditional write, no size check before reading,
no streaming into the destination: the gap between the two is the cost of the backend's
guarantees. Objects go to ``<prefix>.raw-baseline/`` (never a key's name, never touched by the
backend's ``clear``) and are deleted by :meth:`RawBoto3Baseline.close`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import boto3

from hicache_storage.buffers import as_readable, as_writable
from hicache_storage.config import Deployment
from hicache_storage.errors import BatchMismatchError, BufferSizeError
from hicache_storage.keys.validation import validate_key

from .backend import client_config
from .config import S3Config

__all__ = ["BASELINE_PREFIX", "RawBoto3Baseline"]

BASELINE_PREFIX = ".raw-baseline/"
"""Where the baseline's objects live, below the backend's prefix."""


class RawBoto3Baseline:
    """Plain boto3 puts and gets of the same bytes, at the backend's concurrency.

    Parameters
    ----------
    config
        The S3 backend's settings (bucket, prefix, endpoint, client settings, concurrency).
    deployment
        Unused; accepted so that every baseline is built like its backend.
    """

    def __init__(self, config: S3Config, deployment: Deployment | None = None) -> None:
        session = boto3.session.Session(profile_name=config.profile)
        self.client: Any = session.client(
            "s3",
            region_name=config.region,
            endpoint_url=config.endpoint_url,
            config=client_config(config),
        )
        self.bucket = config.bucket
        self.prefix = config.prefix + BASELINE_PREFIX
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrency, thread_name_prefix="hicache-s3-raw"
        )
        self.written: set[str] = set()

    def batch_write(self, names: Sequence[str], values: Sequence[memoryview]) -> None:
        """Put each value as its own object, replacing any earlier one."""
        _check_lengths(names, values)
        objects = [self._object(name) for name in names]
        list(self.pool.map(self._put, objects, values))
        self.written.update(objects)

    def batch_read(self, names: Sequence[str], outs: Sequence[memoryview]) -> None:
        """Get each object and copy it into its output buffer.

        Raises
        ------
        BufferSizeError
            If an object's size differs from its output buffer.
        """
        _check_lengths(names, outs)
        list(self.pool.map(self._get, [self._object(name) for name in names], outs))

    def close(self) -> None:
        """Delete the baseline's objects and release the client and the threads."""
        try:
            objects = sorted(self.written)
            for start in range(0, len(objects), 1000):
                batch = [{"Key": name} for name in objects[start : start + 1000]]
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
        finally:
            self.pool.shutdown(wait=True)
            self.client.close()

    def _object(self, name: str) -> str:
        return self.prefix + validate_key(name)

    def _put(self, name: str, value: memoryview) -> None:
        self.client.put_object(Bucket=self.bucket, Key=name, Body=as_readable(value).tobytes())

    def _get(self, name: str, out: memoryview) -> None:
        view = as_writable(out)
        data = self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        if len(data) != view.nbytes:
            raise BufferSizeError(
                f"baseline object {name!r} holds {len(data)} bytes, not {view.nbytes}"
            )
        view[:] = data


def _check_lengths(names: Sequence[str], buffers: Sequence[memoryview]) -> None:
    if len(names) != len(buffers):
        raise BatchMismatchError(f"got {len(names)} names but {len(buffers)} buffers")
