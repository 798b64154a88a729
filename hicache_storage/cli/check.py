"""``hicache check``: run the conformance suite (or the engine check) against a backend."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import click
import msgspec

from ..config import read_source
from ..errors import ConfigError, HiCacheError
from ..redact import redact_text, secrets_in
from .options import (
    CONFIG_HELP,
    backend_options,
    report_directory,
    resolve_backend,
    writable_file,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from ..conformance.engine import EngineCheck, EngineReport
    from ..conformance.report import ProgressEvent, Report
    from .junit import Case

__all__ = ["check_command", "render", "render_engine", "skip_summary"]

DEFAULT_BACKEND = "file"

_STYLES = {"passed": "green", "failed": "bold red", "error": "bold red", "skipped": "yellow"}


def _probe(backend: str, options: str | None) -> None:
    """Open and close ``backend`` once, so a refusal is one line rather than every check erroring.

    Raises
    ------
    ConfigError
        If the backend cannot be opened with ``options`` (any :class:`HiCacheError`: a refused
        option, a missing client library, an unreachable server; its secrets are masked), or it
        claims a capability whose method it does not implement.
    """
    from ..capabilities import unbacked_claims
    from ..factory import create_backend
    from ..registry import get_spec

    try:
        with create_backend(backend, options) as opened:
            claims = opened.capabilities
    except HiCacheError as exc:
        message = redact_text(str(exc), secrets_in(read_source(options)))
        if options is None and isinstance(exc, ConfigError):
            message += _how_to_give_options(backend)
        raise ConfigError(f"cannot open the {backend} backend: {message}") from None
    unbacked = unbacked_claims(get_spec(backend).load_factory(), claims)
    if unbacked:
        raise ConfigError("; ".join(unbacked) + ": drop the claim or implement the method")


def _how_to_give_options(backend: str) -> str:
    """Say how to give ``backend`` options: ``--config``, and a URL where one names it."""
    from ..urls import url_schemes

    examples = [s.example for s in url_schemes().values() if s.backend == backend and s.example]
    hint = (
        f"\nno options were given: pass --config JSON|@FILE "
        f"(`hicache backends {backend}` lists them)"
    )
    if examples:
        hint += ", or a URL: " + " or ".join(f"hicache check {url}" for url in examples)
    return hint


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


def _name_widths(names: list[str], console: Console, fixed: int) -> tuple[int, int]:
    """Return the widths of a table's name and reason columns: whole names, if the reason keeps 24.

    ``fixed`` is what the table's other columns take, borders included. Both widths are set, as
    rich shrinks every column of a table too wide for the console, and draws one wider than the
    console when a column has a ``min_width``.
    """
    room = max(console.width - fixed, 10)
    longest = max((len(n) for n in names), default=5)
    name = max(min(longest, max(room - 24, room // 2)), 5)
    return name, max(room - name, 5)


def _failure_table(title: str, rows: Sequence[tuple[str, str, str]], console: Console) -> Table:
    """Return a table of ``(name, outcome, reason)`` rows: the checks that failed or errored."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    # Borders and padding (10) and the outcome column (7).
    name_width, reason_width = _name_widths([row[0] for row in rows], console, 17)
    table.add_column("check", overflow="fold", width=name_width)
    table.add_column("outcome", no_wrap=True)
    table.add_column("reason", overflow="fold", width=reason_width)
    for name, outcome, reason in rows:
        table.add_row(Text(name), Text(outcome, style=_STYLES.get(outcome, "")), Text(reason))
    return table


_NOT_CLAIMED = re.compile(r"^backend does not claim capability '([^']+)'$")
"""The skip reason of a check gated on a capability (``fixtures.hicache_capability_gate``)."""


def _checks(count: int) -> str:
    return f"{count} check{'' if count == 1 else 's'}"


def skip_summary(report: Report) -> list[str]:
    """Return one line per reason the checks of ``report`` skipped, most checks first.

    Skips for a capability the backend does not claim are expected and share one last line,
    ``N checks skipped: the backend does not claim X, Y``; any other reason (a hook the backend
    does not provide, an option it does not declare) gets its own line naming the check, or the
    classes of the checks when several share it.
    """
    unclaimed: Counter[str] = Counter()
    others: dict[str, list[str]] = {}
    for row in report.checks:
        if row.outcome != "skipped":
            continue
        reason = row.skip_reason or "no reason given"
        match = _NOT_CLAIMED.match(reason)
        if match and match.group(1) not in report.capabilities:
            unclaimed[match.group(1)] += 1
        else:
            others.setdefault(reason, []).append(row.id)
    lines = []
    for reason, ids in sorted(others.items(), key=lambda item: -len(item[1])):
        if len(ids) == 1:
            where = ids[0]
        else:
            classes = list(dict.fromkeys(check.rpartition("::")[0] or check for check in ids))
            where = ", ".join(classes[:3]) + (", ..." if len(classes) > 3 else "")
        lines.append(f"{_checks(len(ids))} skipped ({where}): {reason}")
    if unclaimed:
        names = ", ".join(name for name, _ in unclaimed.most_common())
        lines.append(
            f"{_checks(sum(unclaimed.values()))} skipped: the backend does not claim {names}"
        )
    return lines


def render(report: Report, console: Console, *, verbose: bool = False) -> None:
    """Print ``report``: a summary line, the failures and the skips that matter.

    The summary line says PASS or FAIL, the counts, the time and what the backend claims; a
    table of the checks that failed or errored follows, then :func:`skip_summary`. With
    ``verbose``, a table of every check comes first and the summary line last instead.
    """
    from rich.table import Table
    from rich.text import Text

    from ..conformance.report import summarize

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
    if not verbose:
        console.print(summary, highlight=False)
        failures = [(row.id, row.outcome, row.message or "") for row in report.failures()]
        if failures:
            console.print(_failure_table("failed checks", failures, console))
        for line in skip_summary(report):
            console.print(Text(line, style="yellow"), highlight=False)
        console.print(
            Text(f"--verbose lists all {_checks(len(report.checks))}.", style="dim"),
            highlight=False,
        )
        return
    table = Table(title=f"hicache check {report.backend}")
    ids = [row.id for row in report.checks]
    # Borders and padding (13), the outcome column (7) and the milliseconds (up to 7).
    name, reason = _name_widths(ids, console, 27)
    table.add_column("check", overflow="fold", width=name)
    table.add_column("outcome", no_wrap=True)
    table.add_column("ms", justify="right", no_wrap=True, width=7)
    table.add_column("skip reason / failure", overflow="fold", width=reason)
    for row in report.checks:
        table.add_row(
            Text(row.id),
            Text(row.outcome, style=_STYLES.get(row.outcome, "")),
            f"{row.duration_s * 1000:,.0f}",
            Text(row.skip_reason or row.message or ""),
        )
    console.print(table)
    console.print(summary, highlight=False)


def render_engine(report: EngineReport, console: Console, *, verbose: bool = False) -> None:
    """Print an engine check's ``report``: a summary line, the failures and the skipped cases.

    With ``verbose``, a table of every case (with the tokens hit per tier and the pages moved)
    comes first and the summary line last instead.
    """
    from rich.table import Table
    from rich.text import Text

    from ..conformance.report import summarize

    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for row in report.checks:
        totals[row.outcome] += 1
    verdict = (
        Text("FAIL", style="bold red") if not report.passed else Text("PASS", style="bold green")
    )
    summary = Text.assemble(
        verdict,
        f" {report.backend} engine check: {summarize(totals)} in {report.duration_s:.1f} s; "
        "every answer compared token for token with recompute",
    )
    if not verbose:
        console.print(summary, highlight=False)
        failures = [(row.name, row.outcome, row.message or "") for row in report.failures()]
        if failures:
            console.print(_failure_table("failed cases", failures, console))
        for row in report.checks:
            if row.outcome == "skipped":
                line = f"skipped {row.name}: {row.message or 'no reason given'}"
                console.print(Text(line, style="yellow"), highlight=False)
        console.print(
            Text(f"--verbose lists all {len(report.checks)} cases.", style="dim"), highlight=False
        )
        return
    table = Table(title=f"hicache check {report.backend} --engine")
    table.add_column("case", overflow="fold")
    table.add_column("outcome", no_wrap=True)
    table.add_column("ms", justify="right", no_wrap=True)
    table.add_column("hit tokens\ndevice/host/storage", justify="right", no_wrap=True)
    table.add_column("pages\nstored/fetched", justify="right", no_wrap=True)
    table.add_column("skip reason / failure", overflow="fold")
    for row in report.checks:
        stats = row.stats
        hits = "/".join(
            f"{stats.get(f'{tier}_hit_tokens', 0):,.0f}" for tier in ("device", "host", "storage")
        )
        pages = f"{stats.get('pages_stored', 0):,.0f}/{stats.get('pages_fetched', 0):,.0f}"
        table.add_row(
            Text(row.name),
            Text(row.outcome, style=_STYLES.get(row.outcome, "")),
            f"{row.duration_s * 1000:,.0f}",
            hits if stats else "",
            pages if stats else "",
            Text(row.message or ""),
        )
    console.print(table)
    console.print(summary, highlight=False)


@contextlib.contextmanager
def _engine_logs(path: str | None) -> Iterator[None]:
    """Send the library's log records to ``path`` (or nowhere) while the engine check runs.

    Its fault cases make storage calls fail on purpose; each failure is logged, and on the
    terminal those lines would bury the table.
    """
    from ..conformance.report import open_private

    logger = logging.getLogger("hicache_storage")
    handler: logging.Handler = logging.NullHandler()
    if path is not None:
        open_private(path).close()  # created 0600 like the report; the handler appends to it
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.propagate = propagate
        logger.removeHandler(handler)
        handler.close()


def _check_engine(
    backend: str, config: str | None, report_dir: str | None, console: Console
) -> EngineReport:
    """Run :func:`~hicache_storage.conformance.engine.check_engine` with a progress display."""
    from ..conformance.engine import check_engine
    from ..conformance.factory import BackendFactory
    from ..conformance.server import find_server_control

    with backend_options(backend, config, "hicache-check-") as options:
        _probe(backend, options)
        factory = BackendFactory.from_source(backend, options)
        control = find_server_control(backend, factory.options)
        log = None if report_dir is None else os.path.join(report_dir, "engine.log")
        with _engine_logs(log):
            if not _interactive(console):
                click.echo(f"running the engine check against {backend}...", err=True)
                return check_engine(factory, server_control=control)
            with console.status(f"engine check of {backend}") as status:

                def progress(check: EngineCheck) -> None:
                    status.update(f"engine check of {backend}: {check.name} {check.outcome}")

                return check_engine(factory, server_control=control, progress=progress)


def _write_junit(
    path: str,
    suite: str,
    cases: list[Case],
    duration_s: float,
    properties: dict[str, str] | None = None,
) -> None:
    """Write the JUnit file, or say in one line why not and exit 2 (the output above stands)."""
    from .junit import write_junit

    try:
        write_junit(path, suite, cases, duration_s, properties)
    except OSError as exc:
        click.echo(f"error: cannot write {path!r}: {exc.strerror or exc}", err=True)
        raise SystemExit(2) from None


@click.command("check")
@click.argument("backend", default=DEFAULT_BACKEND)
@click.option(
    "--config",
    metavar="JSON|@FILE",
    help=CONFIG_HELP,
)
@click.option(
    "--report",
    "report_dir",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Also write report.json and report.md (with --engine: engine.json, engine.log) into DIR.",
)
@click.option(
    "--engine",
    is_flag=True,
    help=(
        "Run the engine check instead of the suite: a tiny model serves conversations through "
        "the backend under every cache policy and fault, each token compared with recompute."
    ),
)
@click.option(
    "--junit-xml",
    "junit_xml",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Also write JUnit XML to FILE: one testcase per check, for CI systems.",
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Print a row for every check (or case), not only the failures and notable skips.",
)
def check_command(
    backend: str,
    config: str | None,
    report_dir: str | None,
    engine: bool,
    junit_xml: str | None,
    verbose: bool,
) -> None:
    """Run the conformance suite against BACKEND (default: file) and summarize the result.

    BACKEND is a backend's name or a URL naming one and some of its options:
    redis://[user:password@]host[:port][/db] and rediss://... (redis; the URL is its `url`),
    s3://BUCKET[/PREFIX] (s3; the endpoint from --config `endpoint_url` or AWS_ENDPOINT_URL),
    file:///PATH (file; its `root`). Keys given with --config win over the URL's.

    Prints one line of counts and the time, a table of the checks that failed or errored, and
    the skips for any reason other than a capability the backend does not claim (those share
    one line); --verbose prints a row for every check instead. --junit-xml FILE writes one
    testcase per check, classed by the check's class, for CI systems.

    Exits 0 when every check passed or skipped, 1 when one failed or errored, 2 on a usage or
    config error or when the backend cannot be opened at all. Without --config, a backend that
    needs a `root` directory or a `path` runs in a fresh temporary one, removed afterwards. On a
    terminal a progress bar shows the checks done; elsewhere nothing is drawn.

    With --engine, the cases of the engine check instead: a tiny seeded model answers
    multi-turn conversations through a KV cache whose pages are evicted to the backend and read
    back, and every answer must equal recomputing it. A server control that a plugin provides
    for the backend adds the case that stops its server mid-run.
    """
    from rich.console import Console

    from ..conformance.report import load_report, open_private, run_suite
    from .junit import engine_cases, suite_cases

    console = Console()
    backend, config = resolve_backend(backend, config)
    if report_dir is not None:
        report_directory(report_dir)
    if junit_xml is not None:
        writable_file(junit_xml, "--junit-xml")
    if engine:
        engine_report = _check_engine(backend, config, report_dir, console)
        render_engine(engine_report, console, verbose=verbose)
        if junit_xml is not None:
            suite = f"hicache check {backend} --engine"
            cases = engine_cases(engine_report)
            _write_junit(junit_xml, suite, cases, engine_report.duration_s)
        if report_dir is not None:
            path = os.path.join(report_dir, "engine.json")
            try:
                with open_private(path) as out:
                    out.write(msgspec.json.format(msgspec.json.encode(engine_report)))
            except OSError as exc:
                # The table above holds the result; say why the file does not, in one line.
                click.echo(f"error: cannot write {path!r}: {exc.strerror or exc}", err=True)
                raise SystemExit(2) from None
            click.echo(f"report: {path}; log: {os.path.join(report_dir, 'engine.log')}")
        if not engine_report.passed:
            raise SystemExit(1)
        return
    with (
        backend_options(backend, config, "hicache-check-") as options,
        _report_dir(report_dir) as target,
    ):
        _probe(backend, options)
        log = os.path.join(target, "pytest.log")
        with open_private(log) as output:
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
    render(report, console, verbose=verbose)
    if junit_xml is not None:
        properties = {"backend": report.backend, "version": report.version}
        properties["capabilities"] = ", ".join(report.capabilities)
        cases = suite_cases(report)
        _write_junit(junit_xml, f"hicache check {backend}", cases, report.duration_s, properties)
    if report_dir is not None:
        click.echo(f"report: {report_dir}/report.json, report.md; pytest output: {log}")
    if report.failures() or status != 0:
        raise SystemExit(1)
