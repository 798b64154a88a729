"""Local servers for tests and benchmarks: child processes started, probed and stopped by PID.

This is the author's kit for a backend that talks to a server, and the core's definition of a
server control (:class:`ServerControl`): the conformance suite's fault checks stop, pause and
restart servers through it, and the hook that hands one to the suite
(``hicache_conformance_server``) is specified in :mod:`hicache_storage.hookspecs`.

A backend that talks to a server ships a ``provision`` module (SQLAlchemy's idea) whose functions
build a :class:`LocalService`: the command lines of the server's processes, the TCP ports that must
accept connections before it counts as up, an optional readiness hook for what an open port does
not prove (a cluster formed, a first write accepted), and the backend options that reach it.

The service keeps its state (each process's command line and PID) in a JSON file, so it survives a
process boundary: a conformance run in a subprocess finds services through :data:`SERVICES_ENV`
and stops and restarts them for the fault checks (the suite's ``hicache_conformance_server`` hook
implementation, :mod:`hicache_storage.conformance.provision`), and
whoever started a service stops the PIDs it finds in that file, including those a restart replaced.
Processes are never looked up or killed by name.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import msgspec
from typing_extensions import Self

from hicache_storage.errors import BackendUnavailableError, ConfigError

__all__ = [
    "SERVICES_ENV",
    "LocalService",
    "PausableServerControl",
    "ProcessSpec",
    "ServerControl",
    "ServiceState",
    "free_port",
    "freeze",
    "port_open",
    "publish",
    "published_services",
    "wait_port",
]

SERVICES_ENV = "HICACHE_SERVICES"
"""``os.pathsep``-separated state files of the running services a fault check may stop."""


@runtime_checkable
class ServerControl(Protocol):
    """Stops and restarts the server a networked backend talks to.

    ``stop``/``start`` are required. A control may also carry ``timeout_s``, the longest a call
    may take while the server is down.
    """

    def stop(self) -> None:
        """Make the server unreachable (stop it, pause it, or drop its traffic)."""
        ...

    def start(self) -> None:
        """Bring the server back; return once it accepts requests again."""
        ...


@runtime_checkable
class PausableServerControl(ServerControl, Protocol):
    """A server control that can also freeze the server without closing its sockets."""

    def pause(self) -> None:
        """Make the server hang: accept or keep connections but answer nothing."""
        ...

    def resume(self) -> None:
        """Undo :meth:`pause`; return once the server accepts requests again."""
        ...


_STOP_GRACE_S = 10.0

_RESERVED: dict[int, socket.socket] = {}
"""Ports of services this process stopped, bound but not listening until the service starts again.

While a server is down its port is free, and any process may take it: a test worker's
:func:`free_port`, an engine's own listener, the kernel's next outgoing connection. The restart
would then fail, or meet the other process's listener and believe it up. A bound socket that
does not listen refuses connections as a stopped server does, and neither ``bind(0)`` nor an
outgoing connection picks a port that one holds.
"""

_RESERVED_LOCK = threading.Lock()

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Servers this process started, kept for the life of the process so that they are reaped when
they exit and never garbage-collected while they run (whichever service object started them)."""


class ProcessSpec(msgspec.Struct, kw_only=True):
    """One server process: how to start it and, while it runs, its PID."""

    name: str
    argv: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    ports: list[int] = msgspec.field(default_factory=list)
    pid: int | None = None


class ServiceState(msgspec.Struct, kw_only=True):
    """Everything needed to start, find and stop a service, as stored in its state file."""

    backend: str
    options: dict[str, Any]
    processes: list[ProcessSpec]
    workdir: str
    ready: str | None = None
    timeout_s: float = 5.0
    start_timeout_s: float = 60.0
    pause_targets: list[str] | None = None
    paused: list[int] = msgspec.field(default_factory=list)


def free_port(*, also: Iterable[int] = ()) -> int:
    """Return a free TCP port on 127.0.0.1 whose ``port + offset`` is free too for each offset.

    Redis Cluster and SeaweedFS open a second port at a fixed offset (+10000) from the first.
    """
    offsets = tuple(also)
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if all(port + offset < 65536 and _bindable(port + offset) for offset in offsets):
            return port
    raise BackendUnavailableError("no free TCP port pair found on 127.0.0.1")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _reserve(port: int) -> None:
    """Hold ``port`` on 127.0.0.1 without listening (see :data:`_RESERVED`); best effort."""
    with _RESERVED_LOCK:
        if port in _RESERVED:
            return
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            return
        _RESERVED[port] = sock


def _release(port: int) -> None:
    """Give back a port :func:`_reserve` held, so the server can bind it."""
    with _RESERVED_LOCK:
        sock = _RESERVED.pop(port, None)
    if sock is not None:
        sock.close()


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """Return whether ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(port: int, deadline: float, host: str = "127.0.0.1") -> None:
    """Wait until ``host:port`` accepts connections; raise once ``monotonic()`` passes deadline."""
    while not port_open(port, host):
        if time.monotonic() > deadline:
            raise BackendUnavailableError(f"{host}:{port} did not open in time")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Return whether ``pid`` runs: exists and is not a zombie whose threads have all exited.

    The main thread of a multi-threaded server turns zombie before its other threads have
    exited, and the process keeps its sockets open until the last one has.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" or threads > 1


def _runs(process: ProcessSpec) -> bool:
    """Return whether the recorded PID is still this process (not a PID the kernel reused)."""
    if process.pid is None or not _alive(process.pid):
        return False
    try:
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return os.fsdecode(cmdline[0]) == process.argv[0]


class LocalService:
    """A server made of local processes; stop/start make it a conformance ``ServerControl``.

    Parameters
    ----------
    state
        The service description; PIDs are filled in as processes start.
    state_file
        Where the state is kept (created or replaced on every change).
    """

    def __init__(self, state: ServiceState, state_file: str | os.PathLike[str]) -> None:
        self.state = state
        self.state_file = Path(state_file)

    @classmethod
    def load(cls, state_file: str | os.PathLike[str]) -> LocalService:
        """Attach to a service from its state file (written by the process that started it)."""
        path = Path(state_file)
        try:
            state = msgspec.json.decode(path.read_bytes(), type=ServiceState)
        except (OSError, msgspec.DecodeError) as exc:
            raise ConfigError(f"cannot read service state {path}: {exc}") from exc
        return cls(state, path)

    @property
    def backend(self) -> str:
        """The registered backend this service serves."""
        return self.state.backend

    @property
    def options(self) -> dict[str, Any]:
        """Backend options that reach this service."""
        return dict(self.state.options)

    @property
    def timeout_s(self) -> float:
        """The longest a backend call may take while the service is down."""
        return self.state.timeout_s

    def log(self, name: str) -> Path:
        """Return the log file of process ``name``."""
        return Path(self.state.workdir) / f"{name}.log"

    def running(self) -> bool:
        """Return whether every process of the service runs."""
        return all(_runs(process) for process in self.state.processes)

    def start(self) -> None:
        """Start whatever is not running, wait for the ports and the readiness hook."""
        self._refresh()
        deadline = time.monotonic() + self.state.start_timeout_s
        try:
            for process in self.state.processes:
                if not _runs(process):
                    for port in process.ports:
                        _release(port)
                    self._spawn(process)
            self._save()
            for process in self.state.processes:
                for port in process.ports:
                    self._wait_port(process, port, deadline)
            if self.state.ready:
                try:
                    _resolve(self.state.ready)(self, deadline)
                except BackendUnavailableError as exc:
                    raise self._exited(exc) from exc
        except BaseException:
            self._save()
            raise

    def pause(self) -> None:
        """Freeze the service with SIGSTOP: its sockets stay open but nothing answers.

        Only the processes named in ``pause_targets`` (every process when ``None``), each with
        its whole process group, so a backend meets a hung server rather than a refused port.
        """
        self._refresh()
        targets = self.state.pause_targets
        try:
            for process in self.state.processes:
                if (targets is None or process.name in targets) and _runs(process):
                    assert process.pid is not None
                    self.state.paused.append(process.pid)
                    freeze(process.pid)
        finally:
            self._save()

    def resume(self) -> None:
        """Undo :meth:`pause` (SIGCONT); return once the service accepts requests again."""
        self._refresh()
        for pid in self.state.paused:
            _signal_group(pid, signal.SIGCONT)
        self.state.paused = []
        self._save()
        self.start()

    def stop(self) -> None:
        """Stop every process by PID: SIGTERM, then SIGKILL after a grace period.

        The ports stay held by this process (bound, not listening: connections are refused)
        until :meth:`start`, so no other process takes them meanwhile; leaving the ``with``
        block gives them back.
        """
        self._refresh()
        for pid in self.state.paused:
            _signal_group(pid, signal.SIGCONT)
        self.state.paused = []
        running = [p for p in self.state.processes if p.pid is not None and _runs(p)]
        for process in running:
            assert process.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in running:
            assert process.pid is not None
            while self._reap(process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._reap(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                while self._reap(process.pid):
                    time.sleep(0.05)
        for process in self.state.processes:
            process.pid = None
            for port in process.ports:
                _reserve(port)
        self._save()

    def release_ports(self) -> None:
        """Give back the ports :meth:`stop` held; the service will not start again."""
        for process in self.state.processes:
            for port in process.ports:
                _release(port)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self.release_ports()

    def _spawn(self, process: ProcessSpec) -> None:
        workdir = Path(self.state.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log(process.name), "ab") as log:
            try:
                child = subprocess.Popen(
                    process.argv,
                    env={**os.environ, **process.env},
                    cwd=process.cwd or workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise BackendUnavailableError(
                    f"cannot start {process.name} ({process.argv[0]}): {exc}"
                ) from exc
        _CHILDREN[child.pid] = child
        process.pid = child.pid

    def _wait_port(self, process: ProcessSpec, port: int, deadline: float) -> None:
        """Wait until ``port`` accepts connections while ``process`` runs.

        A port that opens after the process exited belongs to someone else.
        """
        while True:
            opened = port_open(port)
            if process.pid is None or not self._reap(process.pid):
                raise BackendUnavailableError(
                    f"{process.name} exited before opening port {port}"
                    f"{' (another process holds it)' if opened else ''}; "
                    f"log {self.log(process.name)}:\n{self._tail(process.name)}"
                )
            if opened and _listens(process.pid, port):
                return
            if time.monotonic() > deadline:
                raise BackendUnavailableError(
                    f"{process.name} did not open port {port} within "
                    f"{self.state.start_timeout_s:g}s"
                    f"{' (another process holds it)' if opened else ''}; "
                    f"log {self.log(process.name)}"
                )
            time.sleep(0.05)

    def _exited(self, error: BackendUnavailableError) -> BackendUnavailableError:
        """Name a process that exited in ``error``, with its log, when one has."""
        for process in self.state.processes:
            if process.pid is None or not self._reap(process.pid):
                return BackendUnavailableError(
                    f"{error}; {process.name} exited: log {self.log(process.name)}:\n"
                    f"{self._tail(process.name)}"
                )
        return error

    def _reap(self, pid: int) -> bool:
        """Return whether ``pid`` still runs, collecting it if it is our exited child."""
        child = _CHILDREN.get(pid)
        if child is None:
            return _alive(pid)
        if child.poll() is None:
            return True
        del _CHILDREN[pid]
        return False

    def _tail(self, name: str, lines: int = 20) -> str:
        try:
            text = self.log(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _refresh(self) -> None:
        """Pick up PIDs another process recorded (a restart in a conformance subprocess)."""
        for pid in [pid for pid, child in _CHILDREN.items() if child.poll() is not None]:
            del _CHILDREN[pid]
        if self.state_file.exists():
            stored = LocalService.load(self.state_file).state
            by_name = {p.name: p.pid for p in stored.processes}
            for process in self.state.processes:
                process.pid = by_name.get(process.name, process.pid)
            self.state.paused = list(stored.paused)

    def _save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.state_file.with_suffix(".tmp")
        temporary.write_bytes(msgspec.json.encode(self.state))
        os.replace(temporary, self.state_file)


_FREEZE_S = 5.0
"""How long :func:`freeze` waits for every thread of the group to stop."""


def freeze(pid: int) -> None:
    """SIGSTOP the process group led by ``pid`` and return once every thread of it has stopped.

    ``kill`` returns as soon as the signal is queued; a thread handles it only when it next runs,
    and until one has, the others keep answering. On a loaded machine that window lasts long
    enough for a request sent right after ``kill`` to be served, so a fault check would meet a
    live server it believes frozen.

    Raises
    ------
    BackendUnavailableError
        If some thread has not stopped within a few seconds (the group is left paused).
    """
    _signal_group(pid, signal.SIGSTOP)
    members = _group(pid)
    deadline = time.monotonic() + _FREEZE_S
    while (running := _running_threads(members)) and time.monotonic() < deadline:
        time.sleep(0.001)
    if running:
        raise BackendUnavailableError(
            f"process group {pid} sent SIGSTOP still runs threads {running[:8]} "
            f"after {_FREEZE_S:g}s"
        )


def _group(pgid: int) -> list[Path]:
    """Return the ``/proc`` entries of process ``pgid`` and of every process in group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            if int(entry.name) == pgid or int(fields[2]) == pgid:
                members.append(entry)
        except (OSError, IndexError, ValueError):
            continue
    return members


_TCP_LISTEN = "0A"
"""The state column of a listening socket in ``/proc/net/tcp``."""


def _listening_inodes(port: int) -> set[str] | None:
    """Return the inodes of sockets listening on TCP ``port``; None where ``/proc`` cannot tell."""
    inodes: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            listening = len(fields) > 9 and fields[3] == _TCP_LISTEN
            if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes if readable else None


def _listens(pid: int, port: int) -> bool:
    """Return whether process group ``pid`` holds the socket listening on ``port``.

    An open port proves nothing about whose it is: while a server starts, another process may
    listen there. True where ``/proc`` cannot tell.
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in _group(pid):
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            return True
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd) in wanted:
                    return True
    return False


def _running_threads(members: list[Path]) -> list[int]:
    """Return the threads of ``members`` not stopped (an exited one counts as stopped)."""
    running = []
    for entry in members:
        try:
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("T", "t", "Z", "X"):
                running.append(int(task.name))
    return running


def _signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group led by ``pid`` (or to ``pid`` alone if none)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _resolve(target: str) -> Callable[[LocalService, float], None]:
    module, _, attribute = target.partition(":")
    hook: Callable[[LocalService, float], None] = getattr(
        importlib.import_module(module), attribute
    )
    return hook


@contextlib.contextmanager
def publish(service: LocalService) -> Iterator[LocalService]:
    """Add the service to :data:`SERVICES_ENV` (for child processes too) while the block runs."""
    before = os.environ.get(SERVICES_ENV)
    paths = [p for p in (before or "").split(os.pathsep) if p]
    os.environ[SERVICES_ENV] = os.pathsep.join([*paths, str(service.state_file)])
    try:
        yield service
    finally:
        if before is None:
            os.environ.pop(SERVICES_ENV, None)
        else:
            os.environ[SERVICES_ENV] = before


def published_services() -> list[LocalService]:
    """Return the services listed in :data:`SERVICES_ENV`."""
    paths = [p for p in os.environ.get(SERVICES_ENV, "").split(os.pathsep) if p]
    return [LocalService.load(path) for path in paths]
