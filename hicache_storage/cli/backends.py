"""``hicache backends``: what is registered, whether it is installed and what it promises."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from ..bench import format_size
from ..registry import BackendSpec, registered_backends

__all__ = ["backends_command", "describe"]


def describe(spec: BackendSpec) -> dict[str, Any]:
    """Return the facts ``hicache backends`` shows about one backend, as plain data."""
    caps = spec.capabilities
    return {
        "name": spec.name,
        "extra": spec.extra,
        "install": f"pip install 'hicache-storage[{spec.extra}]'" if spec.extra else "built in",
        "installed": spec.installed(),
        "capabilities": caps.claimed(),
        "max_value_size": caps.max_value_size,
        "baseline": spec.baseline is not None,
        "description": spec.description,
    }


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def backends_command(as_json: bool) -> None:
    """List the registered storage backends."""
    rows = [describe(spec) for spec in registered_backends().values()]
    if as_json:
        click.echo(msgspec.json.encode(rows).decode())
        return

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="hicache-storage backends")
    table.add_column("name", style="bold")
    table.add_column("extra")
    table.add_column("installed")
    table.add_column("capabilities")
    table.add_column("max value", justify="right")
    table.add_column("description")
    for row in rows:
        limit = row["max_value_size"]
        table.add_row(
            Text(row["name"]),
            Text(row["install"]),
            Text("yes", style="green") if row["installed"] else Text("no", style="red"),
            Text(", ".join(row["capabilities"]) or "-"),
            Text("unlimited" if limit is None else format_size(limit)),
            Text(row["description"]),
        )
    Console().print(table)
