"""The ``hicache`` command group: every subcommand, with one way of reporting errors."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TextIO

import click

from ..errors import HiCacheError
from ..registry import PluginLoadWarning
from .backends import backends_command
from .bench import bench_command
from .check import check_command
from .engine import engine_group
from .metadata_server import metadata_server_command

__all__ = ["main"]


class _Group(click.Group):
    """A group that turns library errors into a one-line message and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; report a :class:`HiCacheError` without a traceback."""
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning(warnings.showwarning)
            try:
                return super().invoke(ctx)
            except HiCacheError as exc:
                click.echo(f"error: {exc}", err=True)
                ctx.exit(2)


def _one_line_warning(show: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``warnings.showwarning`` so a plugin that failed to load is one ``warning:`` line."""

    def shown(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, PluginLoadWarning):
            click.echo(f"warning: {message}", err=True)
        else:
            show(message, category, filename, lineno, file, line)

    return shown


@click.group(name="hicache", cls=_Group)
@click.version_option(package_name="hicache-storage", prog_name="hicache")
def main() -> None:
    """Storage tier (L3) of hierarchical KV caches: list backends and measure them."""


main.add_command(backends_command)
main.add_command(bench_command)
main.add_command(check_command)
main.add_command(engine_group)
main.add_command(metadata_server_command)
