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

__all__ = ["CheckResult", "Report", "load_report", "run_suite", "write_report"]

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


def write_report(report: Report, directory: str | os.PathLike[str]) -> Path:
    """Fill in the totals and write ``report.json`` and ``report.md`` into ``directory``."""
    report.totals = _totals(report.checks)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    (target / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    (target / "report.md").write_text(_markdown(report), encoding="utf-8")
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
        if config:
            command += ["--hicache-config", config]
        command += list(extra_args)
        return subprocess.run(command, cwd=workdir, check=False).returncode
