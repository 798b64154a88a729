"""The conformance report: one row per check, written as ``report.json`` and ``report.md``.

:func:`run_suite` runs the suite against a backend in a subprocess (so the caller's own pytest
configuration does not interfere) and :func:`load_report` reads what it wrote. While it runs, the
suite's plugin writes one :data:`ProgressEvent` per JSON line to a progress file that
:func:`run_suite` follows for its ``progress`` callback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import msgspec

from hicache_storage.redact import redact_options, redact_text, secrets_in

__all__ = [
    "CheckResult",
    "Collected",
    "Finished",
    "ProgressEvent",
    "Report",
    "Started",
    "failure_message",
    "load_report",
    "open_private",
    "redacted",
    "run_suite",
    "summarize",
    "write_report",
]

Outcome = Literal["passed", "failed", "skipped", "error"]

_POLL_S = 0.1
"""How often :func:`run_suite` reads new progress lines while the suite runs."""

TIMED_OUT = 124
""":func:`run_suite`'s exit code for a suite killed at its ``timeout_s`` (as ``timeout(1)``)."""


class CheckResult(msgspec.Struct, kw_only=True):
    """One check: its id (``Class::test[param]``), outcome, and why it skipped or failed."""

    id: str
    outcome: Outcome
    duration_s: float = 0.0
    skip_reason: str | None = None
    message: str | None = None
    requires: list[str] = []


class Report(msgspec.Struct, kw_only=True):
    """A whole run: the backend, what it claims, totals by outcome, and every check."""

    backend: str
    version: str
    options: dict[str, Any] = {}
    capabilities: list[str] = []
    max_value_size: int | None = None
    capabilities_error: str | None = None
    totals: dict[str, int] = {}
    duration_s: float = 0.0
    exit_status: int | None = None
    checks: list[CheckResult] = []

    def failures(self) -> list[CheckResult]:
        """Return the checks that failed or errored."""
        return [c for c in self.checks if c.outcome in ("failed", "error")]


class Collected(msgspec.Struct, tag="collected"):
    """The suite has collected ``total`` checks."""

    total: int


class Started(msgspec.Struct, tag="started"):
    """Check ``id`` (``Class::test[param]``) has started."""

    id: str


class Finished(msgspec.Struct, tag="finished"):
    """Check ``id`` has finished with ``outcome``."""

    id: str
    outcome: Outcome


ProgressEvent = Collected | Started | Finished
"""One line of the progress channel between the suite's plugin and :func:`run_suite`."""


def summarize(totals: Mapping[str, int]) -> str:
    """Return ``"171 passed, 0 failed, 5 errored, 16 skipped"`` (errored only when some did)."""
    parts = [f"{totals.get('passed', 0)} passed", f"{totals.get('failed', 0)} failed"]
    if totals.get("error", 0):
        parts.append(f"{totals['error']} errored")
    parts.append(f"{totals.get('skipped', 0)} skipped")
    return ", ".join(parts)


_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = re.compile(r"^(During handling of the above|The above exception was the direct cause)")
_MODULE_PATH = re.compile(r"^(?:[a-z_]\w*\.)+(?=[A-Z]\w*(?::|$))")
_MAX_MESSAGE = 300


def _clean(line: str) -> str:
    """Drop an exception's module path and a redundant ``AssertionError:``."""
    line = _MODULE_PATH.sub("", line.strip())
    return "" if line == "AssertionError" else line.removeprefix("AssertionError:").strip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _final_exception(lines: list[str]) -> str:
    """Return the exception line that ends the last traceback in ``lines``.

    It is the first line after the header indented less than the frames (pytest may indent the
    whole traceback when it is part of an assertion message).
    """
    last = max(i for i, line in enumerate(lines) if line.endswith(_TRACEBACK))
    body = lines[last + 1 :]
    if not body:
        return ""
    frames = _indent(body[0])
    ends = (ln for ln in body if _indent(ln) < frames and not _CHAINED.match(ln.strip()))
    return next(ends, "")


def failure_message(text: str, statement: str | None = None) -> str:
    """Return one line saying what failed, from a failure's exception message.

    ``text`` is the exception's message as pytest reports it; ``statement`` the source line that
    failed. A traceback inside ``text`` (a thread's or a child process's) gives way to the
    exception that ends it; module paths and ``AssertionError:`` are dropped; a bare assertion
    (``assert False``) gets pytest's first ``where`` explanation, else ``statement``.
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    # A header ends its line; one inside a repr (pytest's ``assert not ['Traceback...']``) does not.
    cut = next((i for i, line in enumerate(lines) if line.endswith(_TRACEBACK)), None)
    if cut is not None:
        intro = _clean(" ".join([*lines[:cut], lines[cut].partition(_TRACEBACK)[0]]))
        message = " ".join(part for part in (intro, _clean(_final_exception(lines))) if part)
    elif not lines or not (first := _clean(lines[0])):
        message = statement or "".join(lines[:1])
    elif first.startswith("assert "):
        where = next(
            (ln.lstrip(" +") for ln in lines[1:] if ln.lstrip(" +").startswith("where")), ""
        )
        if where:
            message = f"{first} ({where})"
        else:
            message = f"{statement} failed ({first})" if statement else first
    else:
        message = first
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 1] + "…"


def _totals(checks: Sequence[CheckResult]) -> dict[str, int]:
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for check in checks:
        totals[check.outcome] += 1
    totals["total"] = len(checks)
    return totals


def _markdown(report: Report) -> str:
    caps = ", ".join(report.capabilities) or "none"
    lines = [
        f"# Conformance report: `{report.backend}` {report.version}",
        "",
        f"- capabilities: {caps}",
        f"- max_value_size: {report.max_value_size}",
        "- totals: " + ", ".join(f"{name} {count}" for name, count in report.totals.items()),
        f"- duration: {report.duration_s:.2f} s",
        "",
        "| check | outcome | duration (s) | detail |",
        "|---|---|---|---|",
    ]
    if report.capabilities_error:
        lines.insert(3, f"- capabilities error: {report.capabilities_error}")
    for check in report.checks:
        detail = check.skip_reason or check.message or ""
        detail = detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{check.id}` | {check.outcome} | {check.duration_s:.3f} | {detail} |")
    return "\n".join(lines) + "\n"


def redacted(report: Report) -> Report:
    """Return a copy of ``report`` with the secrets of its options masked everywhere.

    Option values named like secrets (passwords, tokens) and URL passwords become ``***`` in the
    options and in every message: a report is meant to be shared.
    """
    secrets = secrets_in(report.options)

    def scrub(text: str | None) -> str | None:
        return None if text is None else redact_text(text, secrets)

    return msgspec.structs.replace(
        report,
        options=redact_options(report.options),
        capabilities_error=scrub(report.capabilities_error),
        checks=[
            msgspec.structs.replace(
                check, message=scrub(check.message), skip_reason=scrub(check.skip_reason)
            )
            for check in report.checks
        ],
    )


def open_private(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for writing, emptied, readable by its owner only (0600, even if it existed).

    Every file of a report directory may quote the options a run was given.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (see :func:`open_private`)."""
    with open_private(path) as stream:
        stream.write(data)


def write_report(report: Report, directory: str | os.PathLike[str]) -> Path:
    """Fill in the totals and write ``report.json`` and ``report.md`` into ``directory``.

    Secrets are masked (see :func:`redacted`) and the files are readable by their owner only.
    """
    report.totals = _totals(report.checks)
    safe = redacted(report)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    _write_private(target / "report.json", msgspec.json.format(msgspec.json.encode(safe)))
    _write_private(target / "report.md", _markdown(safe).encode("utf-8"))
    return target / "report.json"


def load_report(path: str | os.PathLike[str]) -> Report:
    """Read a report from ``report.json`` or from the directory holding it."""
    source = Path(path)
    if source.is_dir():
        source = source / "report.json"
    return msgspec.json.decode(source.read_bytes(), type=Report)


class _ProgressReader:
    """Follows the progress file the suite appends to, handing each complete line on."""

    def __init__(self, path: Path, callback: Callable[[ProgressEvent], None]) -> None:
        self.path = path
        self.callback = callback
        self.offset = 0
        self.pending = b""

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self.offset)
                chunk = stream.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        for line in lines:
            self.callback(msgspec.json.decode(line, type=ProgressEvent))


def _child_env() -> dict[str, str]:
    """Return this process's environment with ``PYTHONPATH``'s entries made absolute.

    The suite runs in a temporary directory: a relative entry (the guide's ``PYTHONPATH=.``,
    or an empty one, which means the working directory) would otherwise point there, not at the
    caller's module.
    """
    env = dict(os.environ)
    entries = env.get("PYTHONPATH")
    if entries is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(entry or os.curdir) for entry in entries.split(os.pathsep)
        )
    return env


def run_suite(
    name: str,
    config_source: Any,
    report_dir: str | os.PathLike[str],
    extra_args: Sequence[str] = (),
    *,
    output: IO[Any] | None = None,
    progress: Callable[[ProgressEvent], None] | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run the conformance suite against backend ``name`` in a subprocess; return its exit code.

    The subprocess runs in a temporary directory; relative ``PYTHONPATH`` entries are resolved
    against the caller's working directory first, so a plugin found here is found there too.

    Parameters
    ----------
    name
        Registered backend name.
    config_source
        The backend options: ``None``, a mapping, a JSON string or ``"@path"``.
    report_dir
        Where ``report.json`` and ``report.md`` are written.
    extra_args
        More pytest arguments (``-x``, ``-k expr``, ``--hicache-profile nightly``, ...).
    output
        A file that receives pytest's output (stdout and stderr); by default it is inherited.
    progress
        Called in this process with each :data:`ProgressEvent` while the suite runs.
    timeout_s
        The longest the suite process may run; past it, it is killed and the exit code is
        ``TIMED_OUT`` (a backend that leaves threads behind can hold a finished suite at
        interpreter exit, where the per-check limits do not reach). None waits for it.
    """
    if config_source is None:
        config = ""
    elif isinstance(config_source, (str, os.PathLike)):
        config = os.fspath(config_source)
    else:
        config = json.dumps(dict(config_source))
    report_path = Path(report_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="hicache-conformance-") as workdir:
        command = [
            sys.executable,
            "-m",
            "pytest",
            # Block the entry-point copy of the plugin so the explicit one is not registered twice.
            "-p",
            "no:hicache_storage",
            "-p",
            "hicache_storage.conformance.plugin",
            "--hicache-backend",
            name,
            "--hicache-report",
            str(report_path),
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            workdir,
        ]
        if config.startswith("@"):
            config = f"@{os.path.abspath(config[1:])}"  # the suite's working directory differs
        elif config:
            # Through a private file, not argv: argv is visible to every user of the machine.
            path = Path(workdir) / "config.json"
            _write_private(path, config.encode("utf-8"))
            config = f"@{path}"
        if config:
            command += ["--hicache-config", config]
        reader = None
        if progress is not None:
            reader = _ProgressReader(Path(workdir) / "progress.jsonl", progress)
            command += ["--hicache-progress", str(reader.path)]
        command += list(extra_args)
        streams: dict[str, Any] = {}
        if output is not None:
            streams = {"stdout": output, "stderr": subprocess.STDOUT}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with subprocess.Popen(command, cwd=workdir, env=_child_env(), **streams) as suite:
            try:
                while True:
                    try:
                        code = suite.wait(timeout=_POLL_S)
                    except subprocess.TimeoutExpired:
                        if reader is not None:
                            reader.poll()
                        if deadline is not None and time.monotonic() > deadline:
                            suite.kill()
                            suite.wait()
                            return TIMED_OUT
                    else:
                        if reader is not None:
                            reader.poll()
                        return code
            except BaseException:  # interrupted (Ctrl-C, a test's time limit): no orphan suite
                suite.kill()
                suite.wait()
                raise
