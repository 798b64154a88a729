"""``hicache check``: run the conformance suite against a backend and print its report."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click
import msgspec

from ..config import convert, read_source
from ..errors import ConfigError
from ..registry import get_spec

if TYPE_CHECKING:
    from rich.console import Console

    from ..conformance.report import Report

__all__ = ["check_command", "render"]

DEFAULT_BACKEND = "file"

_STYLES = {"passed": "green", "failed": "bold red", "error": "bold red", "skipped": "yellow"}


@contextlib.contextmanager
def _options(backend: str, config: str | None) -> Iterator[str | None]:
    """Yield the config source to run with, validated here so mistakes exit 2 at once.

    Without ``config``, a backend whose options require a ``root`` directory or a ``path`` gets a
    fresh temporary one, removed afterwards.
    """
    spec = get_spec(backend)
    schema = spec.load_config_type()
    if config is not None:
        convert(read_source(config), schema, f"{backend} backend options")
        yield config
        return
    required = {field.name for field in msgspec.structs.fields(schema) if field.required}
    if not required & {"root", "path"}:
        yield None
        return
    scratch = tempfile.mkdtemp(prefix="hicache-check-")
    try:
        options: dict[str, str] = {}
        if "root" in required:
            options["root"] = os.path.join(scratch, "root")
        if "path" in required:
            options["path"] = os.path.join(scratch, "store")
        source = msgspec.json.encode(options).decode()
        convert(read_source(source), schema, f"{backend} backend options")
        yield source
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _report_dir(report: str | None) -> Iterator[str]:
    if report is not None:
        yield report
        return
    scratch = tempfile.mkdtemp(prefix="hicache-check-report-")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Send this process's (and so its children's) stdout and stderr to ``path`` meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "wb") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            return "".join(log.readlines()[-lines:])
    except OSError:
        return ""


def render(report: Report, console: Console) -> None:
    """Print ``report`` as a table of checks and a one-line summary."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"hicache check {report.backend}")
    table.add_column("check", overflow="fold")
    table.add_column("outcome", no_wrap=True)
    table.add_column("ms", justify="right", no_wrap=True)
    table.add_column("skip reason / failure", overflow="fold")
    for row in report.checks:
        table.add_row(
            Text(row.id),
            Text(row.outcome, style=_STYLES.get(row.outcome, "")),
            f"{row.duration_s * 1000:,.0f}",
            Text(row.skip_reason or row.message or ""),
        )
    console.print(table)
    totals = report.totals
    failed = totals.get("failed", 0) + totals.get("error", 0)
    caps = ", ".join(report.capabilities) or "none"
    if report.capabilities_error:
        caps = f"unknown ({report.capabilities_error})"
    verdict = Text("FAIL", style="bold red") if failed else Text("PASS", style="bold green")
    summary = Text.assemble(
        verdict,
        f" {report.backend} {report.version}: {totals.get('passed', 0)} passed, "
        f"{failed} failed, {totals.get('skipped', 0)} skipped in {report.duration_s:.1f} s; "
        f"claims: {caps}",
    )
    console.print(summary, highlight=False)


@click.command("check")
@click.argument("backend", default=DEFAULT_BACKEND)
@click.option(
    "--config",
    metavar="JSON|@FILE",
    help="The backend's options as JSON, or @path to a JSON file.",
)
@click.option(
    "--report",
    "report_dir",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Also write report.json and report.md into DIR.",
)
def check_command(backend: str, config: str | None, report_dir: str | None) -> None:
    """Run the conformance suite against BACKEND (default: file) and print one row per check.

    Exits 0 when no check failed, 1 when one did, 2 on a usage or config error. Without --config,
    a backend that needs a `root` directory or a `path` runs in a fresh temporary one, removed
    afterwards.
    """
    from rich.console import Console

    from ..conformance.report import load_report, run_suite

    with _options(backend, config) as options, _report_dir(report_dir) as target:
        click.echo(f"running the conformance suite against {backend}...", err=True)
        os.makedirs(target, exist_ok=True)
        log = os.path.join(target, "pytest.log")
        with _output_to(log):
            status = run_suite(backend, options, target)
        try:
            report = load_report(target)
        except (OSError, msgspec.DecodeError) as exc:
            click.echo(_tail(log), err=True, nl=False)
            raise ConfigError(
                f"the conformance run of {backend!r} wrote no report (pytest exit status {status})"
            ) from exc
    render(report, Console())
    if report_dir is not None:
        click.echo(f"report: {report_dir}/report.json, report.md; pytest output: {log}")
    failed = report.totals.get("failed", 0) + report.totals.get("error", 0)
    if failed or status != 0:
        raise SystemExit(1)
