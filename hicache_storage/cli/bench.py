"""``hicache bench``: measure a backend against its raw baseline and print a table or JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
import msgspec

from ..bench.backend import BenchReport, OpStats, parse_sizes, run_bench
from ..bench.report import format_size
from .options import CONFIG_HELP, backend_options, resolve_backend

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["bench_command", "render"]


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 100 else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def render(report: BenchReport, console: Console) -> None:
    """Print ``report`` as a table and a one-line summary."""
    from rich.table import Table

    mode = "" if report.mode == "copy" else f" ({report.mode})"
    table = Table(
        title=(
            f"hicache bench {report.backend}{mode}: {report.batch_size} keys/batch, "
            f"{report.batches} batches, {report.repeat} repeats"
        ),
        caption=(
            "GB/s = 10^9 bytes/s; ratio = backend / raw (1.00 = as fast as raw); "
            "hash = page_hashes vs one sha256 per page, keys/s = pages/s"
        ),
    )
    table.add_column("page size", no_wrap=True)
    table.add_column("op", no_wrap=True)
    for column in ("backend GB/s", "raw GB/s", "ratio", "keys/s", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")

    def row(size: str, stats: OpStats, raw: OpStats | None, ratio: float | None) -> None:
        table.add_row(
            size,
            stats.op,
            _num(stats.gb_per_s),
            _num(raw.gb_per_s if raw is not None else None),
            _num(ratio),
            _num(stats.keys_per_s, 0),
            _ms(stats.p50_ms),
            _ms(stats.p99_ms),
        )

    for result in report.results:
        size = format_size(result.page_size)
        row(size, result.set, result.raw_write, result.set_ratio)
        row("", result.exists, None, None)
        row("", result.get, result.raw_read, result.get_ratio)
        table.add_section()
    hashing = report.hashing
    table.add_row(
        f"{hashing.page_tokens} tok",
        "hash",
        _num(hashing.mb_per_s / 1000, 3),
        _num(hashing.raw_mb_per_s / 1000, 3),
        _num(hashing.ratio),
        _num(hashing.pages_per_s, 0),
        "-",
        "-",
    )
    console.print(table)
    console.print(
        f"{report.backend}: set {_pct(report.set_ratio)} / get {_pct(report.get_ratio)} of raw "
        f"(geometric mean over page sizes); page hashing {_pct(hashing.ratio)} of raw sha256",
        highlight=False,
    )


@click.command("bench")
@click.argument("backend")
@click.option(
    "--config",
    metavar="JSON|@FILE",
    help=CONFIG_HELP,
)
@click.option(
    "--page-size",
    "page_size",
    default="1MiB,4MiB",
    show_default=True,
    help="Comma-separated value sizes, e.g. 64KiB,1MiB,4MiB.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--batches", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--v1",
    "v1",
    is_flag=True,
    help="Time the zero-copy batch_set_v1/batch_get_v1 on a registered host pool instead.",
)
@click.option(
    "--layout",
    type=click.Choice(["layer_first", "page_first", "page_first_direct", "page_head"]),
    default="page_first",
    show_default=True,
    help="Host-pool layout of the --v1 mode.",
)
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON report on stdout.")
def bench_command(
    backend: str,
    config: str | None,
    page_size: str,
    batch_size: int,
    batches: int,
    repeat: int,
    v1: bool,
    layout: str,
    as_json: bool,
) -> None:
    """Benchmark BACKEND against its raw baseline (set/exists/get vs plain write/read).

    BACKEND is a backend's name or a URL naming one and some of its options, as for
    `hicache check`: redis://..., rediss://..., s3://BUCKET[/PREFIX], file:///PATH; keys given
    with --config win over the URL's.

    Every value read back is checked byte for byte; wrong bytes abort the run. Without
    --config, a backend that needs a `root` directory or a `path` runs in a fresh temporary one,
    removed afterwards (as with `hicache check`).
    With --v1, pages of a registered MHA host pool move through the zero-copy calls, beside the
    baseline's raw calls on the same page buffers.
    """
    from rich.console import Console

    backend, config = resolve_backend(backend, config)
    sizes = parse_sizes(page_size)
    err = Console(stderr=True)
    with (
        backend_options(backend, config, "hicache-bench-") as options,
        err.status(f"benchmarking {backend}...", spinner="dots") as status,
    ):
        report = run_bench(
            backend,
            options,
            page_sizes=sizes,
            batch_size=batch_size,
            batches=batches,
            repeat=repeat,
            progress=lambda line: status.update(line),
            mode="v1" if v1 else "copy",
            layout=layout,
        )
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        render(report, Console())
