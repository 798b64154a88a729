"""The ``hicache`` command group: every subcommand, with one way of reporting errors."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TextIO

import click

from ..errors import HiCacheError
from ..registry import PluginLoadWarning, plugin_manager
from .backends import backends_command
from .bench import bench_command
from .check import check_command
from .engine import engine_group
from .kernels import kernels_group
from .launch import sglang_args_command, vllm_args_command
from .matrix import matrix_command

__all__ = ["main"]


class _Group(click.Group):
    """A group that turns library errors into a one-line message and exit status 2.

    Besides its own commands it offers those that plugins add (``hicache_cli_commands``), looked
    up when a command is asked for, so a run that needs none never loads them.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Our commands and the plugins', sorted."""
        return sorted({*super().list_commands(ctx), *_plugin_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Our command of that name, else a plugin's."""
        return super().get_command(ctx, cmd_name) or _plugin_commands().get(cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; report a :class:`HiCacheError` without a traceback."""
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning(warnings.showwarning)
            try:
                return super().invoke(ctx)
            except HiCacheError as exc:
                click.echo(f"error: {exc}", err=True)
                ctx.exit(2)


def _plugin_commands() -> dict[str, click.Command]:
    """Collect the commands plugins add, by name (the first plugin to take a name keeps it)."""
    commands: dict[str, click.Command] = {}
    for provided in plugin_manager().hook.hicache_cli_commands():
        for command in provided:
            if command.name is not None:
                commands.setdefault(command.name, command)
    return commands


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
engine_group.add_command(matrix_command)
main.add_command(engine_group)
main.add_command(kernels_group)
main.add_command(sglang_args_command)
main.add_command(vllm_args_command)
