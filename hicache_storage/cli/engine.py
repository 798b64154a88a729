"""``hicache engine bench``: serve one workload over four cache configurations and compare them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click
import msgspec

from ..bench.engine import (
    EXTRA_RUNS,
    PARTS,
    RUNS,
    BenchConfig,
    BenchResult,
    Progress,
    RunResult,
    Spread,
    plot_ttft_by_round,
    run_bench,
)
from ..bench.matrix import GOAL
from ..bench.report import approx_size
from ..config import read_source
from ..engine.model import DTYPES
from ..errors import ConfigError
from .matrix import matrix_command
from .options import backend_options, writable_file
from .settings import SET_HELP, parse_assignment, read_settings_file

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["engine_group", "render"]


_ROUNDING = "; in reduced precision, rounding can flip greedy tokens (try --dtype float32)"


def _same(run: RunResult) -> str:
    if run.identical:
        return "[green]yes[/]"
    return f"[bold red]{run.matching_outputs}/{run.requests}[/]"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def render(result: BenchResult, console: Console) -> None:
    """Print ``result``: tokens and traffic, latency and loads, then mean TTFT by round."""
    config = result.config
    runs = [run for run in result.runs if run.repeat == 0]
    repeats = max((summary.repeats for summary in result.summary), default=1)
    shown = f", repeat 1 of {repeats} (medians below)" if repeats > 1 else ""
    tokens = _table(
        ("L1 hit", "L2 hit", "L3 hit", "computed", "reused", "forwards"),
        title=(
            f"hicache engine bench: {config.workload.kind}, {config.model} on {config.device}, "
            f"backend {config.backend}, {runs[0].requests} requests{shown}"
        ),
        caption=(
            f"prompt tokens; L1 pool {config.engine.device_tokens:,} tokens "
            f"({approx_size(result.device_pool_bytes)}), L2 pool {config.engine.host_tokens:,} "
            f"tokens "
            f"({approx_size(result.host_pool_bytes)}); same: outputs equal to no-cache's"
        ),
    )
    tokens.add_column("same", justify="center")
    for run in runs:
        tokens.add_row(
            run.name,
            f"{run.device_hit_tokens:,}",
            f"{run.host_hit_tokens:,}",
            f"{run.storage_hit_tokens:,}",
            f"{run.computed_tokens:,}",
            f"{run.hit_tokens / run.prompt_tokens:.0%}" if run.prompt_tokens else "-",
            f"{run.forwards:,}",
            _same(run),
        )
    console.print(tokens)

    latency = _table(
        ("TTFT mean", "p50", "p90", "p99", "out tok/s", "all tok/s", "wall s"),
        title=f"latency and throughput{shown}",
        caption="TTFT in ms; tok/s over the run's wall time (out: generated, all: with prompts)",
    )
    for run in runs:
        latency.add_row(
            run.name,
            _ms(run.ttft_mean_s),
            _ms(run.ttft_p50_s),
            _ms(run.ttft_p90_s),
            _ms(run.ttft_p99_s),
            f"{run.generated_tokens_per_s:,.0f}",
            f"{run.total_tokens_per_s:,.0f}",
            f"{run.wall_s:.2f}",
        )
    console.print(latency)
    if repeats > 1:
        _render_repeats(result, console)
        _warn_spread(result, console)
    _render_parts(result, console)
    _render_steps(runs, console)

    loads = _table(
        ("L3 read", "L3 write", "early", "loads", "load ms", "exp. ms", "µs/layer", "exp. %"),
        title="storage traffic and L2→L1 loads",
        caption=(
            "exp.: load time the forward waited for (all of it on a CPU), per layer loaded "
            "and as a share of the load time; early: pages copied to the device while their "
            "request waited for storage"
        ),
    )
    for run in runs:
        per_layer = run.exposed_per_layer_s
        early = run.cache.get("pages_loaded_early", 0) - run.cache.get("early_pages_dropped", 0)
        loads.add_row(
            run.name,
            approx_size(run.storage_bytes_read),
            approx_size(run.storage_bytes_written),
            f"{early:,}",
            f"{run.loads:,}",
            _ms(run.load_s),
            _ms(run.exposed_load_s),
            "-" if per_layer is None else f"{per_layer * 1e6:,.0f}",
            "-" if run.exposed_fraction is None else f"{run.exposed_fraction:.0%}",
        )
    console.print(loads)
    _render_shortfall(runs, console)

    rounds = max(len(run.ttft_by_round_s) for run in runs)
    label = "round" if config.workload.kind == "multiturn" else "query"
    by_round = _table(
        [str(i) for i in range(rounds)],
        title=f"mean TTFT (ms) by {label}" + (f", median of {repeats}" if repeats > 1 else ""),
    )
    for summary in result.summary:
        by_round.add_row(
            summary.name, *(_ms(None if t is None else t.median) for t in summary.ttft_by_round_s)
        )
    console.print(by_round)
    exact = result.model.get("dtype") == "float32"
    for run in runs:
        if not run.identical:
            console.print(
                f"[bold red]warning:[/] {run.name}: {run.requests - run.matching_outputs} of "
                f"{run.requests} outputs differ from no-cache's ({run.matching_first_tokens} "
                f"first tokens agree){'' if exact else _ROUNDING}",
                highlight=False,
            )
        if run.storage_cleared is False:
            console.print(
                f"[yellow]note:[/] backend {config.backend} cannot clear; its L3 hits may "
                "include pages of an earlier run",
                highlight=False,
            )


def _table(columns: Sequence[str], *, title: str, caption: str | None = None) -> Table:
    """Return a table with a ``config`` column, then ``columns`` right-aligned."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    table.add_column("config", no_wrap=True)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def _spread(spread: Spread | None, scale: float = 1e3, digits: int = 1) -> str:
    if spread is None:
        return "-"
    return (
        f"{spread.median * scale:,.{digits}f} "
        f"[dim]({spread.low * scale:,.{digits}f}-{spread.high * scale:,.{digits}f})[/]"
    )


def _render_repeats(result: BenchResult, console: Console) -> None:
    """Print each configuration's median and range over the repeats."""
    table = _table(
        ("TTFT mean", "TTFT p90", "all tok/s", "TTFT/bound"),
        title=f"over {max(s.repeats for s in result.summary)} repeats: median (range)",
        caption="TTFT in ms; all tok/s with prompts",
    )
    for summary in result.summary:
        table.add_row(
            summary.name,
            _spread(summary.ttft_mean_s),
            _spread(summary.ttft_p90_s),
            _spread(summary.total_tokens_per_s, 1.0, 0),
            _spread(summary.ttft_over_bound, 1.0, 2),
        )
    console.print(table)


def _warn_spread(result: BenchResult, console: Console) -> None:
    """Warn where a configuration's repeats spread wider than the matrix's goal allows.

    Two configurations whose medians differ by less than that spread cannot be told apart by
    these runs (a busy machine, most often a CPU shared with other work).
    """
    for summary in result.summary:
        spread = summary.ttft_mean_s
        if spread.low > 0 and spread.high / spread.low > GOAL:
            console.print(
                f"[yellow]warning:[/] {summary.name}: mean TTFT spread "
                f"{_ms(spread.low)}-{_ms(spread.high)} ms over {summary.repeats} repeats "
                f"({spread.high / spread.low - 1:.0%}, more than the {GOAL - 1:.0%} a matrix "
                "cell allows); differences smaller than that are noise",
                highlight=False,
            )


def _render_parts(result: BenchResult, console: Console) -> None:
    """Print where each configuration's mean time to first token went, beside its bound."""
    rates = result.rates
    caption = "mean ms per request; bound: its L3 bytes at the raw parallel read rate"
    if rates is not None:
        read = "-" if rates.raw_read_gbps is None else f"{rates.raw_read_gbps:.1f}"
        per_token = rates.compute_s_per_token
        caption += (
            f" ({read} GB/s) + its cached bytes host-to-device ({rates.host_to_device_gbps:.1f}"
            f" GB/s) + its suffix at {'-' if per_token is None else f'{per_token * 1e6:.1f}'}"
            " µs a token"
        )
    table = _table(
        ("L3 query", "L3 read", "queue", "L2→L1", "compute", "TTFT", "bound", "ratio"),
        title="where the time to first token went",
        caption=caption,
    )
    summaries = result.summary
    for summary in summaries:
        first = result.run(summary.name)
        parts = summary.parts_mean_s
        table.add_row(
            summary.name,
            *(_ms(parts.get(part, 0.0)) for part in PARTS),
            _ms(summary.ttft_mean_s.median),
            _ms(first.bound_mean_s),
            "-" if summary.ttft_over_bound is None else f"{summary.ttft_over_bound.median:.2f}",
        )
    console.print(table)


def _render_steps(runs: Sequence[RunResult], console: Console) -> None:
    """Print where each configuration's scheduler thread spent the run (first repeat)."""
    table = _table(
        ("steps", "forward", "exp. load", "admit", "poll", "release", "host wait", "gc", "idle"),
        title="the scheduler's thread, seconds",
        caption=(
            "forward: the model's forwards (exp. load: of which waiting for L2→L1 copies); "
            "admit: policy, fetch waits and room; poll: finished reads and writes applied; "
            "release: finished requests' write-through; host wait: of admit and release, "
            "waiting for writes to free host room; gc: the garbage collector's pauses, any "
            "thread's (every thread waits); idle: no forward to run (steps without one included)"
        ),
    )
    for run in runs:
        steps = run.steps
        forward = sum(s.forward_s for s in steps)
        admit = sum(s.admit_s for s in steps)
        poll = sum(s.poll_s for s in steps)
        release = sum(s.finish_s for s in steps)
        table.add_row(
            run.name,
            f"{len(steps):,}",
            f"{forward:.2f}",
            f"{sum(s.exposed_load_s for s in steps):.2f}",
            f"{admit:.2f}",
            f"{poll:.2f}",
            f"{release:.2f}",
            f"{sum(s.host_wait_s for s in steps):.2f}",
            f"{sum(s.gc_s for s in steps):.2f}",
            f"{max(run.wall_s - forward - admit - poll - release, 0.0):.2f}",
        )
    console.print(table)


def _render_shortfall(runs: Sequence[RunResult], console: Console) -> None:
    """Print what storage found but did not serve, and what the cache lost (first repeat)."""
    stored = [r for r in runs if r.cache.get("prefetches") or r.cache.get("backup_pages_shed")]
    if not stored:
        return
    names = ("prefetches", "prefetch_priced_out", "prefetch_no_room", "prefetch_pages_cut")
    table = _table(
        ("fetches", "priced out", "no room", "pages cut", "pages lost", "pages shed"),
        title="where storage fell short",
        caption=(
            "priced out: fetches that read nothing, recompute being cheaper; no room: fetches "
            "that found no host room for what storage held; pages cut: found but not read "
            "before their request went; pages lost: computed pages that left the cache "
            "unwritten; pages shed: writes the planner shed, by rule (backlog: more pages "
            "waited behind them than the writer's room; failing: its last writes stored "
            "nothing; unread: a page reads back slower than it computes; probe: a write "
            "measuring it ran)"
        ),
    )
    for run in stored:
        counts = [run.cache.get(name, 0) for name in (*names, "pages_dropped")]
        shed = run.cache.get("backup_pages_shed") or {}
        by_rule = ", ".join(f"{rule} {pages:,}" for rule, pages in sorted(shed.items()))
        table.add_row(run.name, *(f"{count:,}" for count in counts), by_rule or "0")
    console.print(table)


@contextlib.contextmanager
def _progress(console: Console) -> Iterator[Progress]:
    """Show one bar per configuration (requests finished of all); yield the callback."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        tasks = {
            name: bar.add_task(name, total=None, start=False) for name, _ in (*RUNS, *EXTRA_RUNS)
        }

        def advance(name: str, done: int, total: int) -> None:
            task = tasks[name]
            if done == 0:
                bar.start_task(task)
            bar.update(task, completed=done, total=total)

        yield advance


def _take(settings: list[tuple[str, Any]], name: str, flag: str | None, default: Any) -> Any:
    """Take ``name`` out of ``settings``: ``flag`` if given, else its last value or default.

    The backend, its options and the model are read before the rest: they choose the backend's
    scratch directory and the model's default sizes.
    """
    values = [value for path, value in settings if path == name]
    settings[:] = [(path, value) for path, value in settings if path != name]
    return flag if flag is not None else values[-1] if values else default


@click.group("engine")
def engine_group() -> None:
    """Run the tier engine: a real model over a device / host / storage KV cache."""


@engine_group.command("bench")
@click.option("--backend", help="Storage backend (L3)  [default: memory]")
@click.option(
    "--config", metavar="JSON|@FILE", help="The backend's options as JSON, or @path to a JSON file."
)
@click.option(
    "--model",
    metavar="NAME|CONFIG.JSON",
    help="tiny (CPU), 8b (Llama-3-8B shape), 70b-layers (20 Llama-3-70B layers), or a Hugging "
    "Face config.json (Llama, Mistral, Qwen2, Qwen3: its shape, seeded random weights); unset "
    "settings take its defaults  [default: tiny]",
)
@click.option(
    "--workload",
    type=click.Choice(["multiturn", "documents"]),
    help="The workload's kind (workload.kind)  [default: multiturn]",
)
@click.option("--clients", type=click.IntRange(min=1), help="Conversations, or documents.")
@click.option("--rounds", type=click.IntRange(min=1), help="Rounds each, or queries per document.")
@click.option("--device", help="cpu, cuda or cuda:N  [default: cpu]")
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    help="Model and pool dtype (default: the model's own).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    help="Serve every configuration N times in turn; tables show the median and range.",
)
@click.option("--set", "assignments", metavar="PATH=VALUE", multiple=True, help=SET_HELP)
@click.option(
    "--settings",
    "settings_path",
    metavar="FILE",
    help="Settings as a JSON or TOML object: paths as --set's, or nested objects of them.",
)
@click.option(
    "--runs",
    metavar="NAMES",
    help="Comma-separated configurations to run (no-cache always runs: the others are checked "
    "against its tokens); default all four. L1+L2+L3-unverified runs storage without the "
    "end-to-end page check, to measure what it costs.",
)
@click.option(
    "--json",
    "json_path",
    metavar="FILE",
    help="Write the full result as JSON; '-' prints it instead of the tables.",
)
@click.option("--plot", "plot_path", metavar="FILE", help="Write a PNG of mean TTFT by round.")
@click.option("--log-y", is_flag=True, help="Plot TTFT on a log scale.")
@click.option("--force", is_flag=True, help="Run a model other than tiny on a CPU anyway.")
def bench_command(
    backend: str | None,
    config: str | None,
    model: str | None,
    workload: str | None,
    clients: int | None,
    rounds: int | None,
    device: str | None,
    dtype: str | None,
    repeat: int | None,
    assignments: tuple[str, ...],
    settings_path: str | None,
    runs: str | None,
    json_path: str | None,
    plot_path: str | None,
    log_y: bool,
    force: bool,
) -> None:
    """Serve one seeded workload with no cache, then L1, L1+L2 and L1+L2+L3, and compare.

    The device pool is the same in every configuration and the host pool the same with and
    without storage; the backend is cleared before its run. Unset settings take the model's
    defaults, which for `tiny` overflow the device and host pools in a few seconds on a CPU.
    Without --config, a backend that needs a `root` or `path` runs in a temporary directory.
    """
    from rich.console import Console

    settings = read_settings_file(settings_path) if settings_path is not None else []
    settings += [parse_assignment(text) for text in assignments]
    flags = {
        "workload.kind": workload,
        "workload.clients": clients,
        "workload.rounds": rounds,
        "device": device,
        "dtype": dtype,
        "repeat": repeat,
    }
    settings += [(path, value) for path, value in flags.items() if value is not None]
    name = _take(settings, "backend", backend, "memory")
    chosen = _take(settings, "model", model, "tiny")
    for what, value in (("backend", name), ("model", chosen)):
        if not isinstance(value, str):
            raise ConfigError(f"setting {what} must be a string, got {value!r}")
    options = _take(settings, "backend_config", config, None)
    if options is not None and not isinstance(options, str):
        options = msgspec.json.encode(options).decode()
    bench = BenchConfig.for_model(chosen, backend=name).with_settings(settings)
    if bench.model != "tiny" and bench.device == "cpu" and not force:
        raise click.UsageError(
            f"--model {bench.model} is a full-size model in bfloat16, for a GPU (--device cuda); "
            "on a CPU one request takes minutes. Pass --force to run it anyway."
        )
    if plot_path is not None:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            raise click.UsageError(
                "--plot needs matplotlib: pip install 'hicache-storage[engine-bench]'"
            ) from None
        suffix = os.path.splitext(plot_path)[1][1:].lower()
        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix and suffix not in formats:
            raise ConfigError(
                f"--plot {plot_path!r}: matplotlib cannot write .{suffix} files; name a "
                f"{', '.join(sorted(formats))} file"
            )
        writable_file(plot_path, "--plot")
    if json_path not in (None, "-"):
        writable_file(json_path, "--json")
    _check_device(bench.device)
    quiet = json_path == "-"
    err = Console(stderr=True)
    with backend_options(name, options, "hicache-engine-bench-") as source:
        bench = dataclasses.replace(
            bench, backend_config=read_source(source) if source is not None else None
        )
        with _progress(err) as progress:
            result = run_bench(
                bench,
                progress=progress,
                runs=None if runs is None else [r.strip() for r in runs.split(",") if r.strip()],
            )
    if quiet:
        click.echo(result.to_json(indent=2).decode())
    else:
        render(result, Console())
    _write_outputs(result, None if quiet else json_path, plot_path, log_y)


def _check_device(device: str) -> None:
    """Refuse a device the engine cannot run on before any work, as ``cuda`` without CUDA is.

    The engine's model and pools run on ``cpu`` and ``cuda`` only; others (``mps``, ``xpu``,
    ``meta`` ...) would fail inside the model once the backend is open.

    Raises
    ------
    ConfigError
        For another device type, or a CUDA index beyond the devices torch sees.
    """
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"invalid --device {device!r}: {exc}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"--device {device!r}: the engine runs on cpu or cuda (cuda:N), not {parsed.type}"
        )
    count = torch.cuda.device_count() if parsed.type == "cuda" else 0
    if parsed.index is not None and 0 < count <= parsed.index:
        raise ConfigError(f"--device {device!r}: torch sees {count} CUDA device(s)")


def _write_outputs(
    result: BenchResult, json_path: str | None, plot_path: str | None, log_y: bool
) -> None:
    """Write the JSON and the plot of a finished run; a failure is one line and exit 2.

    Called once the result is on the terminal, so a disk that filled during the run loses
    no result, and the other output is still written.
    """
    failed: list[str] = []
    if json_path is not None:
        try:
            with open(json_path, "wb") as out:
                out.write(result.to_json(indent=2))
        except OSError as exc:
            failed.append(f"--json {json_path!r}: {exc.strerror or exc}")
    if plot_path is not None:
        try:
            plot_ttft_by_round(result, plot_path, log_y=log_y)
        except OSError as exc:
            failed.append(f"--plot {plot_path!r}: {exc.strerror or exc}")
    if failed:
        click.echo(
            f"error: cannot write {'; '.join(failed)} (the result is printed above)", err=True
        )
        raise SystemExit(2)


engine_group.add_command(matrix_command)
