"""``hicache check``: run the conformance suite against a backend and print its report."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import click
import msgspec

from ..config import read_source
from ..errors import ConfigError, HiCacheError
from ..redact import redact_text, secrets_in
from .options import backend_options

if TYPE_CHECKING:
    from rich.console import Console

    from ..conformance.report import ProgressEvent, Report

__all__ = ["check_command", "render"]

DEFAULT_BACKEND = "file"

_STYLES = {"passed": "green", "failed": "bold red", "error": "bold red", "skipped": "yellow"}


def _probe(backend: str, options: str | None) -> None:
    """Open and close ``backend`` once, so a refusal is one line rather than every check erroring.

    Raises
    ------
    ConfigError
        If the backend cannot be opened with ``options`` (any :class:`HiCacheError`: a refused
        option, a missing client library, an unreachable server); its secrets are masked.
    """
    from ..factory import create_backend

    try:
        with create_backend(backend, options):
            pass
    except HiCacheError as exc:
        message = redact_text(str(exc), secrets_in(read_source(options)))
        raise ConfigError(f"cannot open the {backend} backend: {message}") from None


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


def _interactive(console: Console) -> bool:
    """Return whether stdout is a terminal a progress bar can redraw (not a CI log or a pipe)."""
    return sys.stdout.isatty() and console.is_terminal and not console.is_dumb_terminal


@contextlib.contextmanager
def _progress_bar(console: Console, backend: str) -> Iterator[Callable[[ProgressEvent], None]]:
    """Show checks done / total and the current class; yield the callback that advances it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..conformance.report import Collected, Finished

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]}", style="bold red"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"checking {backend}", total=None, failed="")
        failed = 0

        def advance(event: ProgressEvent) -> None:
            nonlocal failed
            if isinstance(event, Collected):
                bar.update(task, total=event.total)
                return
            current = event.id.split("::", 1)[0]
            bar.update(task, description=f"checking {backend}: {current}")
            if isinstance(event, Finished):
                failed += event.outcome in ("failed", "error")
                bar.update(task, advance=1, failed=f"{failed} failed" if failed else "")

        yield advance


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

    from ..conformance.report import summarize

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
    caps = ", ".join(report.capabilities) or "none"
    if report.capabilities_error:
        caps = f"unknown ({report.capabilities_error})"
    verdict = (
        Text("FAIL", style="bold red") if report.failures() else Text("PASS", style="bold green")
    )
    summary = Text.assemble(
        verdict,
        f" {report.backend} {report.version}: {summarize(report.totals)} in "
        f"{report.duration_s:.1f} s; claims: {caps}",
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

    Exits 0 when every check passed or skipped, 1 when one failed or errored, 2 on a usage or
    config error or when the backend cannot be opened at all. Without --config, a backend that
    needs a `root` directory or a `path` runs in a fresh temporary one, removed afterwards. On a
    terminal a progress bar shows the checks done; elsewhere nothing is drawn.
    """
    from rich.console import Console

    from ..conformance.report import load_report, run_suite

    console = Console()
    with (
        backend_options(backend, config, "hicache-check-") as options,
        _report_dir(report_dir) as target,
    ):
        _probe(backend, options)
        os.makedirs(target, exist_ok=True)
        log = os.path.join(target, "pytest.log")
        with open(log, "wb") as output:
            if _interactive(console):
                with _progress_bar(console, backend) as advance:
                    status = run_suite(backend, options, target, output=output, progress=advance)
            else:
                click.echo(f"running the conformance suite against {backend}...", err=True)
                status = run_suite(backend, options, target, output=output)
        try:
            report = load_report(target)
        except (OSError, msgspec.DecodeError) as exc:
            click.echo(_tail(log), err=True, nl=False)
            raise ConfigError(
                f"the conformance run of {backend!r} wrote no report (pytest exit status {status})"
            ) from exc
    render(report, console)
    if report_dir is not None:
        click.echo(f"report: {report_dir}/report.json, report.md; pytest output: {log}")
    if report.failures() or status != 0:
        raise SystemExit(1)
