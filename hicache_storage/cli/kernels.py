"""``hicache kernels``: the GPU transfer kernels' benchmark, as a ``hicache`` subcommand."""

from __future__ import annotations

import click

__all__ = ["kernels_group"]


@click.group("kernels")
def kernels_group() -> None:
    """Measure the GPU transfer kernels (host pool <-> device pool)."""


@kernels_group.command(
    "bench",
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_command(args: tuple[str, ...]) -> None:
    """Time the kernels against copy-engine yardsticks on one GPU (--help for the options).

    Prints a table and writes every number to --json (kernel_bench.json by default).
    """
    from ..bench.kernels import main

    status = main(list(args))
    if status:
        raise SystemExit(status)
