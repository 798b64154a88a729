"""A local metadata service for tests and benchmarks (the 3FS data files need no server).

``metadata_service(workdir)`` describes a ``hicache metadata-server`` on a free port of
127.0.0.1 as a :class:`~hicache_storage.kit.services.LocalService`; start and stop it
with ``with service:``, and ``publish(service)`` lets the conformance suite's server-fault checks
stop and restart it. Its ``options`` (``metadata_url`` and, with a token, ``metadata_token``) are
what a 3FS backend config needs to reach it. It counts as started once it accepts writes: a
service without a snapshot refuses them for one lease after it starts (see
:mod:`.metadata_server`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from hicache_storage.errors import BackendUnavailableError
from hicache_storage.kit.services import (
    LocalService,
    ProcessSpec,
    ServiceState,
    free_port,
)

__all__ = ["metadata_service", "wait_ready"]


def wait_ready(service: LocalService, deadline: float) -> None:
    """Readiness hook: wait until the service answers and accepts writes (its grace is over)."""
    url = f"{service.options['metadata_url']}/v1/health"
    request = urllib.request.Request(url)
    token = service.options.get("metadata_token")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    while True:
        try:
            with urllib.request.urlopen(request, timeout=1.0) as response:
                if json.loads(response.read())["grace_s"] <= 0:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise BackendUnavailableError(f"metadata service {url} is not ready")
        time.sleep(0.05)


def metadata_service(
    workdir: str | os.PathLike[str],
    *,
    token: str | None = None,
    snapshot: bool = False,
    lease_s: float = 30.0,
    timeout_s: float = 2.0,
) -> LocalService:
    """Describe a metadata service under ``workdir`` (not started yet).

    Parameters
    ----------
    workdir
        Holds the state file, the log and, with ``snapshot``, the snapshot and journal.
    token
        Bearer token the service requires (passed through its environment, never argv).
    snapshot
        Persist the map to ``workdir/metadata.snapshot`` so a restart keeps it.
    lease_s
        Reservation lease (and start-up grace without a snapshot).
    timeout_s
        The client timeout the backend uses against it: the bound of a call while it is down.
    """
    root = Path(workdir).absolute()
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "hicache_storage.backends.threefs.metadata_server",
        "--port",
        str(port),
        "--lease-s",
        str(lease_s),
    ]
    if snapshot:
        argv += ["--snapshot", str(root / "metadata.snapshot")]
    env = {"THREEFS_METADATA_TOKEN": token} if token else {}
    options: dict[str, object] = {"metadata_url": f"http://127.0.0.1:{port}"}
    if token:
        options["metadata_token"] = token
    state = ServiceState(
        backend="3fs",
        options=options,
        processes=[ProcessSpec(name="metadata", argv=argv, env=env, ports=[port])],
        workdir=str(root),
        ready=f"{__name__}:wait_ready",
        timeout_s=timeout_s,
        start_timeout_s=30.0 + lease_s,  # a fresh service waits one lease before writes
    )
    return LocalService(state, root / "service.json")
