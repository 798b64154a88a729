"""Local services start, answer, stop by PID, and survive a restart from another process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_storage.conformance.server import find_server_control
from hicache_storage.errors import BackendUnavailableError
from hicache_storage.kit.services import (
    SERVICES_ENV,
    LocalService,
    ProcessSpec,
    ServerControl,
    ServiceState,
    free_port,
    port_open,
    publish,
)


def http_service(tmp_path: Path, port: int) -> LocalService:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    state = ServiceState(
        backend="memory",
        options={"url": f"http://127.0.0.1:{port}"},
        processes=[ProcessSpec(name="http", argv=argv, ports=[port])],
        workdir=str(tmp_path / "svc"),
        timeout_s=1.5,
    )
    return LocalService(state, tmp_path / "svc" / "state.json")


def test_start_stop_by_pid(tmp_path: Path) -> None:
    port = free_port()
    service = http_service(tmp_path, port)
    with service:
        assert port_open(port) and service.running()
        pid = service.state.processes[0].pid
        assert pid is not None
        assert LocalService.load(service.state_file).state.processes[0].pid == pid
        assert isinstance(service, ServerControl) and service.timeout_s == 1.5
    assert not port_open(port) and not service.running()
    assert LocalService.load(service.state_file).state.processes[0].pid is None


def test_restart_elsewhere_is_stopped_by_the_owner(tmp_path: Path) -> None:
    port = free_port()
    owner = http_service(tmp_path, port)
    owner.start()
    try:
        script = (
            "import sys; from hicache_storage.kit.services import LocalService;"
            "s = LocalService.load(sys.argv[1]); s.stop(); s.start()"
        )
        subprocess.run([sys.executable, "-c", script, str(owner.state_file)], check=True)
        restarted = LocalService.load(owner.state_file).state.processes[0].pid
        assert restarted is not None and restarted != owner.state.processes[0].pid
        assert port_open(port)
    finally:
        owner.stop()
    assert not port_open(port)


def test_published_service_is_the_server_control(tmp_path: Path) -> None:
    port = free_port()
    service = http_service(tmp_path, port)
    service._save()
    before = os.environ.get(SERVICES_ENV)
    with publish(service):
        found = find_server_control("memory", {"url": f"http://127.0.0.1:{port}", "x": 1})
        assert isinstance(found, LocalService) and found.state_file == service.state_file
        assert find_server_control("memory", {"url": "http://elsewhere"}) is None
        assert find_server_control("file", {"url": f"http://127.0.0.1:{port}"}) is None
    assert os.environ.get(SERVICES_ENV) == before


def dying_service(tmp_path: Path, port: int, says: str) -> LocalService:
    """A service whose one process prints ``says`` and exits before opening ``port``."""
    argv = [sys.executable, "-c", f"import sys; print({says!r}); sys.exit(3)"]
    state = ServiceState(
        backend="memory",
        options={},
        processes=[ProcessSpec(name="dies", argv=argv, ports=[port])],
        workdir=str(tmp_path),
        start_timeout_s=10,
    )
    return LocalService(state, tmp_path / "state.json")


def test_process_that_dies_reports_its_log(tmp_path: Path) -> None:
    service = dying_service(tmp_path, free_port(), "boom: bad flag")
    with pytest.raises(BackendUnavailableError, match="boom: bad flag"):
        service.start()
    service.stop()


def test_a_stopped_service_keeps_its_port_until_it_starts(tmp_path: Path) -> None:
    port = free_port()
    with http_service(tmp_path, port) as service:
        service.stop()
        assert not port_open(port)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        service.start()
        assert port_open(port) and service.running()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))


def test_a_port_another_process_opened_is_not_the_server_up(tmp_path: Path) -> None:
    port = free_port()
    service = dying_service(tmp_path, port, "cannot bind")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(BackendUnavailableError, match="another process holds it"):
            service.start()
    service.stop()
    service.release_ports()


def test_failed_start_in_a_with_block_stops_what_it_started(tmp_path: Path) -> None:
    port, closed = free_port(), free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    state = ServiceState(
        backend="memory",
        options={},
        processes=[ProcessSpec(name="http", argv=argv, ports=[port, closed])],
        workdir=str(tmp_path),
        start_timeout_s=2,
    )
    service = LocalService(state, tmp_path / "state.json")
    with pytest.raises(BackendUnavailableError, match=f"did not open port {closed}"), service:
        pass
    assert not port_open(port) and not service.running()


def test_free_port_leaves_offset_free() -> None:
    port = free_port(also=(10000,))
    assert not port_open(port) and not port_open(port + 10000)


_BUSY = """
import http.server, sys, threading
def spin():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
address = ("127.0.0.1", int(sys.argv[1]))
http.server.HTTPServer(address, http.server.BaseHTTPRequestHandler).serve_forever()
"""


def _thread_states(pid: int) -> list[str]:
    tasks = Path(f"/proc/{pid}/task")
    return [(t / "stat").read_text().rsplit(")", 1)[-1].split()[0] for t in tasks.iterdir()]


def test_pause_returns_once_every_thread_has_stopped(tmp_path: Path) -> None:
    """``kill`` only queues SIGSTOP: threads waiting for a CPU would still answer a request."""
    port = free_port()
    state = ServiceState(
        backend="memory",
        options={},
        processes=[
            ProcessSpec(name="busy", argv=[sys.executable, "-c", _BUSY, str(port)], ports=[port])
        ],
        workdir=str(tmp_path),
    )
    with LocalService(state, tmp_path / "state.json") as service:
        pid = service.state.processes[0].pid
        assert pid is not None
        for _ in range(20):
            service.pause()
            states = _thread_states(pid)
            service.resume()
            assert len(states) == 5 and set(states) == {"T"}, states
