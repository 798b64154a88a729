"""The ``hicache`` command group: every subcommand, with one way of reporting errors."""

from __future__ import annotations

from typing import Any

import click

from ..errors import HiCacheError
from .backends import backends_command
from .bench import bench_command
from .check import check_command
from .metadata_server import metadata_server_command

__all__ = ["main"]


class _Group(click.Group):
    """A group that turns library errors into a one-line message and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; report a :class:`HiCacheError` without a traceback."""
        try:
            return super().invoke(ctx)
        except HiCacheError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)


@click.group(name="hicache", cls=_Group)
@click.version_option(package_name="hicache-storage", prog_name="hicache")
def main() -> None:
    """Storage tier (L3) of hierarchical KV caches: list backends and measure them."""


main.add_command(backends_command)
main.add_command(bench_command)
main.add_command(check_command)
main.add_command(metadata_server_command)
