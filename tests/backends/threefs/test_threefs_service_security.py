"""The metadata service against hostile and mistaken use (issue 14, items 10-13).

A real ``hicache metadata-server`` process per test, measured from outside with psutil: an
unauthenticated client's huge bodies are refused before they are read (its memory does not
grow), bad ``Content-Length`` headers are refused unread, hundreds of half-open connections
neither stop legitimate calls nor grow its threads and are closed after the client timeout, and
whatever keeps it from starting is one line on stderr with exit status 2.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from hicache_storage.backends.threefs.metadata import Geometry
from hicache_storage.backends.threefs.metadata_http import MAX_BODY_BYTES, HttpMetadata

MiB = 1 << 20
TOKEN = "s3cret-token-for-tests"
GEO = Geometry(slot_bytes=4096, slots_per_file=64, file_count=2)
_SERVER = [sys.executable, "-m", "hicache_storage.backends.threefs.metadata_server"]
_CLI = [sys.executable, "-c", "from hicache_storage.cli import main; main()", "metadata-server"]
_BANNER = re.compile(r"on http://\S+:(\d+) ")


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ps(self) -> psutil.Process:
        return psutil.Process(self.process.pid)

    def client(self, token: str | None = TOKEN, timeout_s: float = 5.0) -> HttpMetadata:
        return HttpMetadata(self.url, token=token, timeout_s=timeout_s)

    def connections(self) -> int:
        """Established TCP connections the server process holds."""
        return sum(1 for c in self.ps.net_connections("tcp") if c.status == "ESTABLISHED")


@contextlib.contextmanager
def service(tmp_path: Path, *args: str, token: str | None = TOKEN) -> Iterator[Service]:
    """Run a metadata service on a free port; stop it by PID (SIGTERM, then SIGKILL)."""
    log = tmp_path / f"service-{time.monotonic_ns()}.log"
    argv = [*_SERVER, "--port", "0", "--lease-s", "0.1", *args]
    env = {**os.environ}
    env.pop("THREEFS_METADATA_TOKEN", None)
    if token is not None:
        env["THREEFS_METADATA_TOKEN"] = token
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 30
        while (match := _BANNER.search(log.read_text())) is None:
            assert process.poll() is None, f"the service exited: {log.read_text()}"
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.05)
        yield Service(process, int(match.group(1)), log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def status_of(sock: socket.socket, timeout: float = 5.0) -> int:
    """Read an HTTP status line from ``sock`` within ``timeout`` (0 if the server closed)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return 0
        data += chunk
    return int(data.split(b" ", 2)[1])


def request_head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""]
    return "\r\n".join(lines).encode()


def rss(process: psutil.Process) -> int:
    return int(process.memory_info().rss)


def warm_up(svc: Service) -> None:
    """Make the calls a client makes, so the server's own first-use allocations are done."""
    meta = svc.client()
    try:
        meta.open("ns", GEO)
        for _ in range(20):
            meta.lookup("ns", [f"k{i}" for i in range(500)])
            meta.exists("ns", ["a", "b"])
    finally:
        meta.close()


# -- item 11: nothing is read before authentication, Content-Length is bounded ------------------


def test_unauthenticated_huge_bodies_get_401_without_the_server_growing(tmp_path: Path) -> None:
    with service(tmp_path) as svc:
        warm_up(svc)
        before = rss(svc.ps)
        peak = before
        statuses: list[int] = []
        sent: list[int] = []
        body = b"x" * MiB

        def attacker(i: int) -> None:
            total = 0
            with socket.create_connection(("127.0.0.1", svc.port)) as sock:
                auth = "Authorization: Bearer wrong" if i % 2 else "X-Nothing: 1"
                sock.sendall(
                    request_head("/v1/lookup", "Content-Length: 66060288", auth)  # 63 MiB
                )
                with contextlib.suppress(OSError):
                    sock.sendall(body)
                    total += len(body)
                statuses.append(status_of(sock))
                with contextlib.suppress(OSError):
                    sock.settimeout(5.0)
                    for _ in range(62):
                        sock.sendall(body)
                        total += len(body)
            sent.append(total)

        attackers = [threading.Thread(target=attacker, args=(i,)) for i in range(8)]
        for thread in attackers:
            thread.start()
        while any(thread.is_alive() for thread in attackers):
            peak = max(peak, rss(svc.ps))
            time.sleep(0.02)
        after = rss(svc.ps)
        print(
            f"RSS before {before / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, after "
            f"{after / MiB:.1f} MiB; 8 clients sent {sum(sent) / MiB:.0f} MiB unauthenticated"
        )
        assert statuses == [401] * 8
        assert peak - before < 24 * MiB
        meta = svc.client()
        assert meta.exists("ns", ["a"]) == 0  # still serving
        meta.close()


@pytest.mark.parametrize(
    ("length", "status"),
    [("-1", 400), ("abc", 400), ("1e3", 400), (None, 411), (str(MAX_BODY_BYTES + 1), 413)],
)
def test_bad_content_length_is_refused_without_reading(
    tmp_path: Path, length: str | None, status: int
) -> None:
    with (
        service(tmp_path, token=None) as svc,
        socket.create_connection(("127.0.0.1", svc.port)) as sock,
    ):
        headers = [] if length is None else [f"Content-Length: {length}"]
        sock.sendall(request_head("/v1/lookup", *headers))  # and no body at all
        started = time.monotonic()
        assert status_of(sock, timeout=5.0) == status
        assert time.monotonic() - started < 2.0


def test_chunked_bodies_are_refused(tmp_path: Path) -> None:
    with (
        service(tmp_path, token=None) as svc,
        socket.create_connection(("127.0.0.1", svc.port)) as sock,
    ):
        sock.sendall(request_head("/v1/lookup", "Transfer-Encoding: chunked"))
        assert status_of(sock) == 411


def test_a_body_that_stalls_is_timed_out(tmp_path: Path) -> None:
    with (
        service(tmp_path, "--client-timeout-s", "1") as svc,
        socket.create_connection(("127.0.0.1", svc.port)) as sock,
    ):
        sock.sendall(
            request_head("/v1/lookup", "Content-Length: 100", f"Authorization: Bearer {TOKEN}")
        )
        sock.sendall(b'{"ns": "n')
        started = time.monotonic()
        assert status_of(sock, timeout=10.0) == 408
        assert time.monotonic() - started < 5.0


def test_the_token_is_checked_and_a_right_one_works(tmp_path: Path) -> None:
    with service(tmp_path) as svc:
        good, bad, none = svc.client(), svc.client("wrong"), svc.client(None)
        try:
            assert good.open("ns", GEO)
            for client in (bad, none):
                with pytest.raises(Exception, match="refused the token"):
                    client.exists("ns", ["a"])
        finally:
            for client in (good, bad, none):
                client.close()


# -- item 13: slowloris -------------------------------------------------------------------------


def half_open(port: int, count: int) -> list[socket.socket]:
    """Open ``count`` connections that send part of a request line and then nothing."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/lookup HTT")
        socks.append(sock)
    return socks


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_open_connections_neither_block_calls_nor_grow_threads(tmp_path: Path) -> None:
    timeout_s = 4.0
    with service(tmp_path, "--client-timeout-s", str(timeout_s)) as svc:
        warm_up(svc)
        threads_before = svc.ps.num_threads()
        opened = time.monotonic()
        socks = half_open(svc.port, 500)
        try:
            time.sleep(0.3)  # let the server accept them all
            held = svc.connections()
            threads_under_attack = svc.ps.num_threads()
            meta = svc.client(timeout_s=2.0)
            latencies = []
            for i in range(20):
                started = time.monotonic()
                meta.lookup("ns", [f"key{i}"])
                latencies.append(time.monotonic() - started)
            meta.close()
            cpu = svc.ps.cpu_percent(interval=0.5)
            time.sleep(max(0.0, opened + timeout_s + 2.0 - time.monotonic()))
            closed = sum(closed_by_peer(sock) for sock in socks)
        finally:
            for sock in socks:
                sock.close()
        print(
            f"500 half-open: server held {held} connections, threads {threads_before} -> "
            f"{threads_under_attack}, CPU {cpu:.0f} %, legitimate lookup max "
            f"{max(latencies) * 1000:.1f} ms (median {sorted(latencies)[10] * 1000:.1f} ms); "
            f"{closed}/500 closed by the server after its {timeout_s:g} s timeout"
        )
        assert max(latencies) < 2.0
        assert threads_under_attack <= threads_before + 4
        assert closed == 500


def test_past_max_connections_the_oldest_unauthorized_are_closed(tmp_path: Path) -> None:
    with service(tmp_path, "--max-connections", "50", "--client-timeout-s", "60") as svc:
        meta = svc.client(timeout_s=2.0)
        meta.open("ns", GEO)  # an authorized connection: kept while others come and go
        socks = half_open(svc.port, 200)
        try:
            time.sleep(0.5)
            held = svc.connections()
            assert held <= 50
            started = time.monotonic()
            assert meta.exists("ns", ["a"]) == 0  # the kept connection still works
            fresh = svc.client(timeout_s=2.0)
            assert fresh.exists("ns", ["a"]) == 0  # and a new client gets in
            fresh.close()
            assert time.monotonic() - started < 2.0
            assert sum(closed_by_peer(sock) for sock in socks[:100]) == 100  # the oldest went
        finally:
            meta.close()
            for sock in socks:
                sock.close()


# -- item 10 and 12: refusing to start, in one line ---------------------------------------------


def start_fails(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``argv`` that must refuse to start; return its one line of stderr."""
    environ = {k: v for k, v in os.environ.items() if k != "THREEFS_METADATA_TOKEN"}
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, env={**environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} started serving instead of refusing")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture(params=["cli", "module"])
def command(request: pytest.FixtureRequest) -> list[str]:
    """``hicache metadata-server`` and ``python -m ...metadata_server`` behave the same."""
    return _CLI if request.param == "cli" else _SERVER


def test_snapshot_in_a_missing_directory_is_one_line(command: list[str]) -> None:
    line = start_fails([*command, "--port", "0", "--snapshot", "/nonexistent/d/s"])
    assert "/nonexistent/d/s" in line


@pytest.mark.parametrize("where", ["file-as-directory", "directory", "unwritable", "corrupt"])
def test_unusable_snapshot_is_one_line(tmp_path: Path, where: str) -> None:
    if where == "file-as-directory":
        (tmp_path / "file").write_text("")
        snapshot = tmp_path / "file" / "meta.snapshot"
    elif where == "directory":
        snapshot = tmp_path
    elif where == "unwritable":
        snapshot = Path("/proc/hicache-meta.snapshot")  # not writable, even for root
    else:
        snapshot = tmp_path / "meta.snapshot"
        snapshot.write_text('{"namespaces": {"ns": {"geometry": 5}}}')
    start_fails([*_CLI, "--port", "0", "--snapshot", str(snapshot)])


def test_port_in_use_is_one_line(command: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = start_fails([*command, "--port", str(port)])
    assert str(port) in line


@pytest.mark.parametrize("host", ["bad host!", "256.1.1.1", "-x"])
def test_bad_host_is_one_line(host: str) -> None:
    start_fails([*_CLI, "--port", "0", "--host", host])


def test_bad_option_value_is_one_line() -> None:
    start_fails([*_CLI, "--port", "99999"])


@pytest.mark.parametrize("content", ["", "   \n\t\n", "two words", b"\xff\xfe"])
def test_empty_or_unusable_token_file_refuses_to_start(
    tmp_path: Path, command: list[str], content: str | bytes
) -> None:
    token_file = tmp_path / "token"
    if isinstance(content, bytes):
        token_file.write_bytes(content)
    else:
        token_file.write_text(content)
    start_fails([*command, "--port", "0", "--token-file", str(token_file)])


@pytest.mark.parametrize("which", ["missing", "directory"])
def test_unreadable_token_file_is_one_line(tmp_path: Path, which: str) -> None:
    token_file = tmp_path / "missing" if which == "missing" else tmp_path
    start_fails([*_CLI, "--port", "0", "--token-file", str(token_file)])


def test_whitespace_token_in_the_environment_refuses_to_start() -> None:
    start_fails([*_CLI, "--port", "0"], env={"THREEFS_METADATA_TOKEN": "  "})


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_beyond_loopback_without_a_token_refuses_to_start(command: list[str], host: str) -> None:
    line = start_fails([*command, "--port", "0", "--host", host])
    assert "--insecure-no-auth" in line


def test_beyond_loopback_starts_with_a_token_or_the_explicit_flag(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with service(tmp_path, "--host", "0.0.0.0", "--token-file", str(token_file), token=None) as svc:
        meta = svc.client()
        assert meta.exists("ns", ["a"]) == 0
        meta.close()
    with service(tmp_path, "--host", "0.0.0.0", "--insecure-no-auth", token=None) as svc:
        assert "no token" in svc.log.read_text()
        meta = svc.client(None)
        assert meta.exists("ns", ["a"]) == 0
        meta.close()


def test_loopback_without_a_token_still_starts(tmp_path: Path) -> None:
    with service(tmp_path, "--host", "localhost", token=None) as svc:
        meta = svc.client(None)
        assert meta.exists("ns", ["a"]) == 0
        meta.close()


# -- shutdown and persistence still hold --------------------------------------------------------


def test_sigterm_under_attack_snapshots_and_exits(tmp_path: Path) -> None:
    snapshot = tmp_path / "meta.snapshot"
    with service(tmp_path, "--snapshot", str(snapshot), "--lease-s", "1") as svc:
        meta = svc.client()
        meta.open("ns", GEO)
        deadline = time.monotonic() + 10
        while (grant := meta.reserve("ns", GEO, [("kept", 100)])).grants[0].status != "reserved":
            assert time.monotonic() < deadline  # a fresh service grants after one lease
            time.sleep(0.1)
        assert meta.commit("ns", grant.epoch, [grant.grants[0].id]) == [True]
        meta.close()
        socks = half_open(svc.port, 50)
        started = time.monotonic()
        svc.process.send_signal(signal.SIGTERM)
        assert svc.process.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
        for sock in socks:
            sock.close()
    with service(tmp_path, "--snapshot", str(snapshot)) as svc:
        meta = svc.client()
        assert meta.exists("ns", ["kept"]) == 1
        meta.close()
