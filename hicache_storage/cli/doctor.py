"""``hicache doctor``: check a deployment before it serves (:mod:`hicache_storage.doctor`)."""

from __future__ import annotations

import json

import click

from ..doctor import LLAMA3_8B_BYTES_PER_TOKEN, ServingPlan, diagnose
from .options import CONFIG_HELP, resolve_backend

__all__ = ["doctor_command"]

_MARKS = {
    "ok": "[green]ok[/]",
    "warn": "[yellow]warn[/]",
    "fail": "[bold red]FAIL[/]",
    "skip": "skip",
}


@click.command("doctor")
@click.argument("backend")
@click.option("--config", help=CONFIG_HELP)
@click.option("--page-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--bytes-per-token",
    type=click.IntRange(min=1),
    default=LLAMA3_8B_BYTES_PER_TOKEN,
    show_default=True,
    help="KV bytes a token on one rank (default: Llama-3-8B in bf16).",
)
@click.option("--device-tokens", type=click.IntRange(min=1), help="The device pool's tokens.")
@click.option("--host-tokens", type=click.IntRange(min=1), help="The host pool's tokens.")
@click.option(
    "--host-ratio",
    type=click.FloatRange(min=0, min_open=True),
    help="The host pool as a multiple of the device pool (SGLang's --hicache-ratio).",
)
@click.option(
    "--prefetch-policy",
    type=click.Choice(["timeout", "best_effort", "wait_complete"]),
    default="timeout",
    show_default=True,
    help="SGLang's --hicache-storage-prefetch-policy.",
)
@click.option(
    "--prefetch-timeout-base", type=click.FloatRange(min=0), default=1.0, show_default=True
)
@click.option(
    "--prefetch-timeout-per-ki-token", type=click.FloatRange(min=0), default=0.25, show_default=True
)
@click.option(
    "--prefetch-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="The prefix length whose prefetch is timed.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def doctor_command(
    backend: str,
    config: str | None,
    page_tokens: int,
    bytes_per_token: int,
    device_tokens: int | None,
    host_tokens: int | None,
    host_ratio: float | None,
    prefetch_policy: str,
    prefetch_timeout_base: float,
    prefetch_timeout_per_ki_token: float,
    prefetch_tokens: int,
    as_json: bool,
) -> None:
    """Check a deployment of BACKEND before it serves; exit 1 if a check fails.

    Names the traps of hierarchical KV caches: a missing client library, an unreachable store,
    pages a second client cannot read back, a prefetch slower than the timeout that cuts it
    short, a host pool that leaves prefetches no room, a local disk near full. Writes a few
    pages of --page-tokens x --bytes-per-token under a fresh prefix and deletes them after.
    """
    from rich.console import Console

    if host_ratio is not None:
        if host_tokens is not None:
            raise click.UsageError("give --host-tokens or --host-ratio, not both")
        if device_tokens is None:
            raise click.UsageError("--host-ratio needs --device-tokens")
        host_tokens = int(device_tokens * host_ratio)
    name, source = resolve_backend(backend, config)
    plan = ServingPlan(
        page_tokens=page_tokens,
        bytes_per_token=bytes_per_token,
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        prefetch_policy=prefetch_policy,  # type: ignore[arg-type]
        timeout_base_s=prefetch_timeout_base,
        timeout_per_ki_token_s=prefetch_timeout_per_ki_token,
        prefetch_tokens=prefetch_tokens,
    )
    findings = diagnose(name, source, plan)
    failed = any(f.status == "fail" for f in findings)
    if as_json:
        rows = [
            {"check": f.check, "status": f.status, "detail": f.detail, "fix": f.fix}
            for f in findings
        ]
        click.echo(json.dumps({"backend": name, "ok": not failed, "findings": rows}, indent=1))
    else:
        from rich.table import Table

        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True, style="bold")
        table.add_column()
        for f in findings:
            fix = f"\n[dim]fix:[/] {f.fix}" if f.fix and f.status in ("warn", "fail") else ""
            table.add_row(_MARKS[f.status], f.check, f.detail + fix)
        console = Console(highlight=False)
        console.print(table)
        console.print(f"{name}: " + ("a check failed" if failed else "no check failed"))
    raise SystemExit(1 if failed else 0)
