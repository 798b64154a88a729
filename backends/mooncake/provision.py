"""Local Mooncake servers for tests and benchmarks: a master and a long-lived segment holder.

Objects live in the segments clients mount, and a client's ``close()`` drops the objects in its
segment. So the test store is a ``mooncake_master`` plus one ``mooncake_client`` process that
only holds a segment; test clients mount none (``global_segment_size=0``) and their data
outlives them. Both binaries ship inside the mooncake wheel. Everything binds 127.0.0.1 on free
ports and is stopped by PID (:mod:`hicache_storage.kit.services`).

Only the master's service is published for the conformance suite's fault checks: stopping or
pausing it is the outage (the holder stays up and re-mounts its segment when the master returns).
Once a holder has mounted, the master counts as ready only when the holder's segment is mounted
again, so a check that restarts the master gets a store that can take puts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from hicache_storage.errors import BackendUnavailableError, MissingDependencyError
from hicache_storage.kit.services import (
    LocalService,
    ProcessSpec,
    ServiceState,
    free_port,
    publish,
)

from .config import DEFAULT_DEADLINE_S

__all__ = [
    "HOLDER_BACKEND",
    "binary",
    "holder_ready",
    "holder_service",
    "local_services",
    "local_store",
    "master_ready",
    "master_service",
    "metrics_address",
]

HOLDER_BACKEND = "mooncake-segment-holder"
"""The ``backend`` of the holder's service: no backend has this name, so the fault checks
never pick the holder."""

_TIMEOUT_S = DEFAULT_DEADLINE_S
"""What a call may take while the master is down or paused: the backend's default
``deadline_s`` (the option the suite's fault checks run the backend with)."""

_HOLDER_MARK = "holder-mounted"
"""A file in the master's workdir: once there, master_ready also waits for segment capacity."""


def binary(name: str) -> str:
    """Return the path of a binary shipped in the mooncake wheel (``mooncake_master``, ...).

    Raises
    ------
    MissingDependencyError
        If the mooncake package is not installed or lacks the binary.
    """
    spec = importlib.util.find_spec("mooncake")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, name)
        if os.access(path, os.X_OK):
            return path
    raise MissingDependencyError(
        f"{name} not found in the mooncake package; run: pip install "
        "'hicache-storage[mooncake-cpu]' (or [mooncake] on CUDA hosts)"
    )


def _http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return int(response.status), response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def metrics_address(service: LocalService) -> str:
    """Return ``host:port`` of the master's HTTP metrics (the backend's ``master_metrics``).

    The master's second port; a holder names its master's in its options.
    """
    metrics = service.options.get("metrics")
    return str(metrics) if metrics else f"127.0.0.1:{service.state.processes[0].ports[1]}"


def master_ready(service: LocalService, deadline: float) -> None:
    """Wait until the master's ``/health`` answers 200 (and, with a holder, it has capacity).

    After a restart the master knows no segment until the holder re-mounts (1-3 s); a store
    without one refuses every put, so it is not ready yet.
    """
    url = f"http://{metrics_address(service)}/health"
    while _http_get(url)[0] != 200:
        if time.monotonic() > deadline:
            raise BackendUnavailableError(f"mooncake master health {url} did not answer 200")
        time.sleep(0.05)
    mark = Path(service.state.workdir) / _HOLDER_MARK
    if mark.exists():
        _wait_capacity(service, deadline, Path(mark.read_text() or service.state.workdir))


def holder_ready(service: LocalService, deadline: float) -> None:
    """Wait until the master reports segment capacity (the holder mounted its segment)."""
    _wait_capacity(service, deadline, service.log("holder"))


def _wait_capacity(service: LocalService, deadline: float, log: Path) -> None:
    url = f"http://{metrics_address(service)}/metrics"
    while True:
        status, text = _http_get(url)
        for line in text.splitlines() if status == 200 else []:
            name, _, value = line.partition(" ")
            if name == "master_total_capacity_bytes" and float(value or 0) > 0:
                return
        if time.monotonic() > deadline:
            raise BackendUnavailableError(
                f"the mooncake segment holder did not mount its segment ({url}); log {log}"
            )
        time.sleep(0.1)


def master_service(
    workdir: str | os.PathLike[str], *, timeout_s: float = _TIMEOUT_S
) -> LocalService:
    """Describe a ``mooncake_master`` on free 127.0.0.1 ports (RPC, then HTTP metrics)."""
    root = Path(workdir)
    rpc = free_port()
    metrics = free_port()
    argv = [
        binary("mooncake_master"),
        "-rpc_address=127.0.0.1",
        f"-rpc_port={rpc}",
        "-metrics_host=127.0.0.1",
        f"-metrics_port={metrics}",
        "-logtostderr=true",
    ]
    state = ServiceState(
        backend="mooncake",
        options={"master": f"127.0.0.1:{rpc}"},
        processes=[ProcessSpec(name="master", argv=argv, ports=[rpc, metrics])],
        workdir=str(root),
        ready=f"{__name__}:master_ready",
        timeout_s=timeout_s,
        start_timeout_s=30.0,
    )
    return LocalService(state, root / "master.json")


def holder_service(
    workdir: str | os.PathLike[str], master: LocalService, *, segment: str = "512MB"
) -> LocalService:
    """Describe a ``mooncake_client`` that only holds a ``segment``-sized global segment."""
    root = Path(workdir)
    port = free_port()
    argv = [
        binary("mooncake_client"),
        "-host=127.0.0.1",
        "-metadata_server=P2PHANDSHAKE",
        f"-master_server_address={master.options['master']}",
        f"-global_segment_size={segment}",
        f"-port={port}",
        "-protocol=tcp",
        "-logtostderr=true",
    ]
    state = ServiceState(
        backend=HOLDER_BACKEND,
        options={"master": master.options["master"], "metrics": metrics_address(master)},
        processes=[ProcessSpec(name="holder", argv=argv, ports=[port])],
        workdir=str(root),
        ready=f"{__name__}:holder_ready",
        start_timeout_s=30.0,
    )
    return LocalService(state, root / "holder.json")


@contextlib.contextmanager
def local_services(
    workdir: str | os.PathLike[str], *, segment: str = "512MB"
) -> Iterator[tuple[LocalService, LocalService]]:
    """Run a master and a segment holder; yield both services (neither is published).

    Both are stopped by PID when the block ends, the holder first. From then on the master
    counts as ready only with the holder's segment mounted (see :func:`master_ready`).
    """
    master = master_service(Path(workdir) / "master")
    holder = holder_service(Path(workdir) / "holder", master, segment=segment)
    with master, holder:
        (Path(master.state.workdir) / _HOLDER_MARK).write_text(str(holder.log("holder")))
        yield master, holder


@contextlib.contextmanager
def local_store(
    workdir: str | os.PathLike[str], *, segment: str = "512MB"
) -> Iterator[LocalService]:
    """Run a master and a segment holder; yield the master's (published) service.

    Both are stopped by PID when the block ends, the holder first.
    """
    with local_services(workdir, segment=segment) as (master, _), publish(master):
        yield master
