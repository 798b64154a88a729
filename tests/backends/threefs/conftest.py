"""A real metadata service for the 3FS backend's tests, started once per session, stopped by PID.

The data files live in temporary directories (no 3FS can run here). The service is published in
``$HICACHE_SERVICES`` so the conformance suite, run in a subprocess, can stop and restart it for
its server-fault checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.backends.threefs.provision import metadata_service
from hicache_storage.kit.services import LocalService, publish

MiB = 1 << 20

# 2 files of 32 MiB in 64 KiB slots: the suite's 4 MiB values fit, and its bounded check
# (values of a sixteenth of the capacity) overfills it quickly.
GEOMETRY: dict[str, Any] = {"file_size": 32 * MiB, "file_count": 2, "slot_bytes": 64 << 10}
LEASE_S = 2.0
TIMEOUT_S = 1.5


def service_options(service: LocalService, root: Path, **extra: Any) -> dict[str, Any]:
    """Options of a backend over ``root`` that shares ``service``."""
    return {"path": str(root), **GEOMETRY, **service.options, "timeout_s": TIMEOUT_S, **extra}


@pytest.fixture(scope="session")
def shared_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    """A metadata service with a token and a short lease, published for the fault checks."""
    service = metadata_service(
        tmp_path_factory.mktemp("metadata"), token="t0ken", lease_s=LEASE_S, timeout_s=TIMEOUT_S
    )
    with service, publish(service):
        yield service


@pytest.fixture
def private_service(tmp_path: Path) -> Iterator[LocalService]:
    """A service of its own for a test that stops, kills or restarts it (no snapshot)."""
    service = metadata_service(tmp_path / "metadata", lease_s=LEASE_S, timeout_s=TIMEOUT_S)
    with service:
        yield service


@pytest.fixture
def persistent_service(tmp_path: Path) -> Iterator[LocalService]:
    """A service of its own that persists its map to a snapshot and journal.

    Its reservations' lease is long (60 s): the test that uses it kills and restarts the service
    while a reservation is pending, which takes longer than the other services' 2 s lease on a
    loaded machine (the reservation then expires, as it should, and the check of its survival
    fails for the wrong reason).
    """
    service = metadata_service(
        tmp_path / "metadata", snapshot=True, lease_s=60.0, timeout_s=TIMEOUT_S
    )
    with service:
        yield service
