"""``hicache backends``: what is registered, who provides it, whether it is installed, its promises.

The table fits an 80-column terminal (one capability per line; the wider columns only when there is
room, or with ``--wide``); ``hicache backends NAME`` shows everything about one backend.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import click
import msgspec

from ..bench.report import format_size
from ..errors import HiCacheError
from ..registry import (
    BackendSpec,
    BrokenPlugin,
    Origin,
    broken_plugins,
    get_spec,
    origin_of,
    registered_backends,
)

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table
    from rich.text import Text

__all__ = ["backends_command", "describe"]

_ROOMY = 140
"""Terminal width from which the table shows every column without ``--wide``."""


def _provided_by(origin: Origin | None) -> dict[str, Any]:
    """Return who provides a plugin: ``built in``, ``<distribution> <version>`` or run time."""
    return {
        "provider": "registered at run time" if origin is None else str(origin),
        "distribution": None if origin is None else origin.distribution,
        "version": None if origin is None else origin.version,
    }


def describe(spec: BackendSpec) -> dict[str, Any]:
    """Return the facts ``hicache backends`` shows about one backend, as plain data."""
    caps = spec.capabilities
    origin = origin_of(spec.name)
    provided = _provided_by(origin)
    distribution = spec.distribution if origin is None else origin.distribution
    return {
        "name": spec.name,
        **provided,
        "extra": spec.extra,
        "install": (
            f"pip install '{distribution}[{spec.extra}]'" if spec.extra else provided["provider"]
        ),
        "installed": spec.installed(),
        "requires": list(spec.requires),
        "capabilities": caps.claimed(),
        "max_value_size": caps.max_value_size,
        "baseline": spec.baseline is not None,
        "namespace_option": spec.namespace_option,
        "description": spec.description,
        "error": None,
    }


def _describe_broken(plugin: BrokenPlugin) -> dict[str, Any]:
    """Return a row for a plugin that failed to load."""
    return {
        "name": plugin.name,
        **_provided_by(plugin.origin),
        "installed": False,
        "capabilities": [],
        "error": plugin.error,
    }


def _options(spec: BackendSpec) -> list[str]:
    """Return ``name = default`` as JSON (or ``name (required)``) for each backend option."""
    try:
        schema = spec.load_config_type()
    except HiCacheError as exc:
        return [f"unknown: {exc}"]
    shown: list[str] = []
    for field in msgspec.structs.fields(schema):
        if field.required:
            shown.append(f"{field.name} (required)")
            continue
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        try:
            text = msgspec.json.encode(default).decode()
        except (TypeError, msgspec.EncodeError):
            text = repr(default)
        shown.append(f"{field.name} = {text}")
    return shown


def _detail(spec: BackendSpec, console: Console) -> None:
    """Print every fact about one backend, one per line."""
    from rich.table import Table
    from rich.text import Text

    row = describe(spec)
    caps = spec.capabilities
    unclaimed = [f.name for f in dataclasses.fields(caps) if getattr(caps, f.name) is False]
    limit = row["max_value_size"]
    facts: list[tuple[str, RenderableType]] = [
        ("name", Text(spec.name, style="bold")),
        ("description", Text(spec.description or "-")),
        ("provided by", Text(row["provider"])),
        ("installed", _installed(row)),
        ("install", Text(row["install"])),
        ("requires", Text(", ".join(spec.requires) or "-")),
        ("capabilities", Text("\n".join(row["capabilities"]) or "none")),
        ("not claimed", Text("\n".join(unclaimed) or "-")),
        ("max value", Text("unlimited" if limit is None else format_size(limit))),
        ("baseline", Text(spec.baseline or "none")),
        ("namespace option", Text(spec.namespace_option or "none")),
        ("factory", Text(spec.factory)),
        ("config", Text(spec.config)),
        ("options", Text("\n".join(_options(spec)) or "none")),
    ]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, value in facts:
        grid.add_row(label, value)
    console.print(grid)


def _installed(row: dict[str, Any]) -> Text:
    from rich.text import Text

    if row["error"] is not None:
        return Text("broken", style="bold red")
    return Text("yes", style="green") if row["installed"] else Text("no", style="red")


def _provider_cell(row: dict[str, Any]) -> str:
    """Return the provider, a third party's version on a line of its own (a narrower column)."""
    if row["provider"] == f"{row['distribution']} {row['version']}":
        return f"{row['distribution']}\n{row['version']}"
    return str(row["provider"])


def _table(rows: list[dict[str, Any]], full: bool) -> Table:
    """Return the table: name, provider, installed, capabilities (and the rest when ``full``)."""
    from rich.table import Table
    from rich.text import Text

    caption = None if full else "more: --wide, or hicache backends NAME"
    table = Table(title="hicache-storage backends", caption=caption)
    table.add_column("name", style="bold", overflow="fold")
    table.add_column("provided by", overflow="fold")
    table.add_column("installed", no_wrap=True)
    table.add_column("capabilities", no_wrap=True)
    if full:
        table.add_column("install", overflow="fold")
        table.add_column("max value", justify="right", no_wrap=True)
        table.add_column("description", overflow="fold")
    for row in rows:
        cells: list[RenderableType] = [
            Text(row["name"]),
            Text(_provider_cell(row)),
            _installed(row),
            Text("\n".join(row["capabilities"]) or "-"),
        ]
        if full and row["error"] is None:
            limit = row["max_value_size"]
            cells += [
                Text("-" if row["installed"] else row["install"]),
                Text("unlimited" if limit is None else format_size(limit)),
                Text(row["description"]),
            ]
        elif full:
            cells += [Text("-"), Text("-"), Text(row["error"], style="red")]
        table.add_row(*cells)
    return table


@click.command("backends")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--wide",
    is_flag=True,
    help="Show every column (install hint, max value, description), however wide the terminal.",
)
def backends_command(name: str | None, as_json: bool, wide: bool) -> None:
    """List the registered storage backends, or show everything about backend NAME.

    Plugins that failed to load are listed as broken, with their error.
    """
    from rich.console import Console
    from rich.measure import Measurement
    from rich.text import Text

    console = Console()
    if name is not None:
        spec = get_spec(name)
        if as_json:
            click.echo(msgspec.json.encode({**describe(spec), "options": _options(spec)}).decode())
        else:
            _detail(spec, console)
        return

    rows = [describe(spec) for spec in registered_backends().values()]
    broken = list(broken_plugins())
    rows += [_describe_broken(plugin) for plugin in broken]
    if as_json:
        click.echo(msgspec.json.encode(rows).decode())
        return

    table = _table(rows, full=wide or console.width >= _ROOMY)
    if wide:
        natural = Measurement.get(console, console.options.update_width(1_000_000), table)
        console = Console(width=max(console.width, natural.maximum))
    console.print(table)
    for plugin in broken:
        console.print(
            Text.assemble(("broken plugin ", "bold red"), f"{plugin.name}: {plugin.error}"),
            highlight=False,
        )
