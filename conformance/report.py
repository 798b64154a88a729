"""The conformance report: one row per check, written as ``report.json`` and ``report.md``.

:func:`run_suite` runs the suite against a backend in a subprocess (so the caller's own pytest
configuration does not interfere) and :func:`load_report` reads what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from hicache_storage.redact import redact_options, redact_text, secrets_in

__all__ = ["CheckResult", "Report", "load_report", "redacted", "run_suite", "write_report"]

Outcome = Literal["passed", "failed", "skipped", "error"]


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


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600, even if it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as stream:
            stream.write(data)
    finally:
        os.close(fd)


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


def run_suite(
    name: str,
    config_source: Any,
    report_dir: str | os.PathLike[str],
    extra_args: Sequence[str] = (),
) -> int:
    """Run the conformance suite against backend ``name`` in a subprocess; return its exit code.

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
        if config and not config.startswith("@"):
            # Through a private file, not argv: argv is visible to every user of the machine.
            path = Path(workdir) / "config.json"
            _write_private(path, config.encode("utf-8"))
            config = f"@{path}"
        if config:
            command += ["--hicache-config", config]
        command += list(extra_args)
        return subprocess.run(command, cwd=workdir, check=False).returncode
