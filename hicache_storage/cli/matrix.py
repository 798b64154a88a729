"""``hicache engine matrix``: the storage tier against no cache and the host, cell by cell."""

from __future__ import annotations

from collections.abc import Sequence

import click

from ..bench.matrix import CellResult, cell_details, cells, run_matrix
from ..config import read_source
from ..engine.policies import PrefetchPolicy, WritePolicy
from ..errors import ConfigError
from .options import backend_options, writable_file
from .settings import SET_HELP, parse_assignment

__all__ = ["matrix_command"]


def _names(value: str, choices: Sequence[str], option: str) -> list[str]:
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown or not names:
        raise ConfigError(f"{option} takes a comma-separated list of {', '.join(choices)}")
    return names


def _ratios(value: str) -> list[float]:
    try:
        ratios = [float(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--ratios takes comma-separated numbers, got {value!r}") from None
    if not ratios or any(not 0 < ratio < 1e6 for ratio in ratios):
        raise ConfigError(f"--ratios takes positive numbers, got {value!r}")
    return ratios


def _row(result: CellResult) -> list[str]:
    def ms(values: dict[str, float], name: str) -> str:
        return f"{values[name] * 1e3:.0f}" if name in values else "-"

    flag = "[red]worse[/]" if result.worse else "ok"
    return [
        result.cell.label,
        f"{ms(result.ttft_mean_s, 'no-cache')} / {ms(result.ttft_p99_s, 'no-cache')}",
        f"{ms(result.ttft_mean_s, 'L1+L2')} / {ms(result.ttft_p99_s, 'L1+L2')}",
        f"{ms(result.ttft_mean_s, 'L1+L2+L3')} / {ms(result.ttft_p99_s, 'L1+L2+L3')}",
        f"{result.mean_ratio:.2f} / {result.p99_ratio:.2f}",
        f"{result.goal:g}",
        str(result.storage_hit_tokens),
        flag if result.identical else f"{flag}, outputs differ",
    ]


@click.command("matrix")
@click.option("--backend", default="file", show_default=True, help="Storage backend (L3).")
@click.option("--config", help="Backend options: JSON, a JSON/TOML file, or '-' for stdin.")
@click.option(
    "--models",
    default="tiny",
    show_default=True,
    help="Comma-separated bench models (tiny, 8b, 70b-layers) or config.json paths.",
)
@click.option("--ratios", default="0.5,1,2,4", show_default=True, help="Host/device ratios.")
@click.option(
    "--write-policies",
    default=",".join(p.value for p in WritePolicy),
    show_default=True,
    help="Comma-separated write policies.",
)
@click.option(
    "--prefetch-policies",
    default=PrefetchPolicy.ADAPTIVE.value,
    show_default=True,
    help="Comma-separated prefetch policies.",
)
@click.option(
    "--failing/--no-failing",
    default=True,
    show_default=True,
    help="Add a failing-store cell per model (every storage call fails after 50 ms).",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--clients", type=click.IntRange(min=1), help="Documents.")
@click.option("--rounds", type=click.IntRange(min=1), help="Queries per document.")
@click.option("--set", "assignments", metavar="PATH=VALUE", multiple=True, help=SET_HELP)
@click.option("--json", "json_path", metavar="FILE", help="Write every cell's figures as JSON.")
@click.option(
    "--details",
    "details_path",
    metavar="FILE",
    help="Append each cell's runs (breakdowns, planner, storage calls) as a JSON line as it ends.",
)
def matrix_command(
    backend: str,
    config: str | None,
    models: str,
    ratios: str,
    write_policies: str,
    prefetch_policies: str,
    failing: bool,
    device: str,
    clients: int | None,
    rounds: int | None,
    assignments: tuple[str, ...],
    json_path: str | None,
    details_path: str | None,
) -> None:
    """Serve a documents workload per cell: models x host ratios x write x prefetch policies.

    Each cell runs no cache, L1+L2 and L1+L2+L3 and prints L1+L2+L3's mean / p99 TTFT over the
    better of the other two (a failing-store cell: over L1+L2), beside the goal it must meet.
    Settings not given take the first model's defaults, for every cell; a cell's model,
    host pool, policies and faults are its own.
    """
    import torch
    from rich.console import Console
    from rich.table import Table

    from ..bench.engine import BenchConfig

    grid = cells(
        [m.strip() for m in models.split(",") if m.strip()],
        _ratios(ratios),
        _names(write_policies, [p.value for p in WritePolicy], "--write-policies"),
        _names(prefetch_policies, [p.value for p in PrefetchPolicy], "--prefetch-policies"),
        failing=failing,
    )
    for path, option in ((json_path, "--json"), (details_path, "--details")):
        if path is not None:
            writable_file(path, option)
    flags = {"device": device, "workload.clients": clients, "workload.rounds": rounds}
    settings = [
        ("workload.kind", "documents"),
        *(parse_assignment(text) for text in assignments),
        *((path, value) for path, value in flags.items() if value is not None),
    ]
    console = Console()
    table = Table(
        "cell",
        "no cache ms mean / p99",
        "L1+L2",
        "L1+L2+L3",
        "ratio mean / p99",
        "goal",
        "L3 hit tokens",
        "verdict",
        title="L1+L2+L3 over the better of no cache and L1+L2",
    )
    with backend_options(backend, config, "hicache-engine-matrix-") as options:
        base = BenchConfig.for_model(
            grid[0].model,
            backend=backend,
            backend_config=read_source(options) if options is not None else None,
        ).with_settings(settings)

        def done(cell: CellResult) -> None:
            console.print(f"{cell.cell.label}: {' | '.join(_row(cell)[1:])}")
            if device.startswith("cuda"):
                free, total = torch.cuda.mem_get_info(torch.device(device))
                held = torch.cuda.memory_allocated(torch.device(device))
                console.print(
                    f"  {device}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
                    f"{held / 2**30:.1f} GiB held by tensors"
                )
            if details_path is not None:
                with open(details_path, "ab") as out:
                    out.write(cell_details(cell) + b"\n")

        result = run_matrix(base, grid, done=done)
    for cell in result.cells:
        table.add_row(*_row(cell))
    console.print(table)
    if json_path is not None:
        with open(json_path, "wb") as out:
            out.write(result.to_json())
