"""The ``hicache`` command group: every subcommand, with one way of reporting errors."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any, TextIO

import click

from ..errors import HiCacheError
from ..registry import PluginLoadWarning, plugin_manager

__all__ = ["main"]

COMMANDS: dict[str, tuple[str, str, str]] = {
    "backends": (
        "backends",
        "backends_command",
        "List the registered storage backends, or show everything about backend NAME.",
    ),
    "bench": (
        "bench",
        "bench_command",
        "Benchmark BACKEND against its raw baseline (set/exists/get vs plain write/read).",
    ),
    "check": (
        "check",
        "check_command",
        "Run the conformance suite against BACKEND (default: file) and summarize the result.",
    ),
    "doctor": (
        "doctor",
        "doctor_command",
        "Check a deployment of BACKEND before it serves; exit 1 if a check fails.",
    ),
    "engine": (
        "engine",
        "engine_group",
        "Run the tier engine: a real model over a device / host / storage KV cache.",
    ),
    "kernels": (
        "kernels",
        "kernels_group",
        "Measure the GPU transfer kernels (host pool <-> device pool).",
    ),
    "sglang-args": (
        "launch",
        "sglang_args_command",
        "Print the SGLang launch flags that serve with BACKEND as the storage tier (L3).",
    ),
    "vllm-args": (
        "launch",
        "vllm_args_command",
        "Print the vLLM launch flag that serves with BACKEND as a storage tier of KV offloading.",
    ),
}
"""Our subcommands: name -> (module of ``hicache_storage.cli``, attribute, short help).

A module is imported only when its command runs, so ``hicache --version``, ``--help`` and the
light commands never import the engine and torch. The short help is the command's own first
docstring line (a test holds them equal), kept here so ``--help`` imports nothing."""


def _load(name: str) -> click.Command:
    module, attribute, _ = COMMANDS[name]
    command: click.Command = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
    return command


class _Group(click.Group):
    """A group that turns library errors into a one-line message and exit status 2.

    Its own commands are imported when asked for (:data:`COMMANDS`); besides them it offers
    those that plugins add (``hicache_cli_commands``), looked up when a command is asked for, so
    a run that needs none never loads them.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Our commands and the plugins', sorted."""
        return sorted({*COMMANDS, *_plugin_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Our command of that name, else a plugin's."""
        if cmd_name in COMMANDS:
            return _load(cmd_name)
        return _plugin_commands().get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List the commands with their short help, importing only plugins' commands."""
        plugins = _plugin_commands()
        rows = [(name, help_) for name, (_, _, help_) in COMMANDS.items()]
        rows += [
            (name, command.get_short_help_str(300))
            for name, command in plugins.items()
            if name not in COMMANDS and not command.hidden
        ]
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))

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
