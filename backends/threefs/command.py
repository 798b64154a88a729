"""``hicache metadata-server``: the key → slot map the 3FS backend's processes share.

The 3FS plugin adds this command to the ``hicache`` CLI through the ``hicache_cli_commands`` hook,
as any plugin may add its own; ``python -m hicache_storage.backends.threefs.metadata_server``
runs the same command.

Whatever keeps it from starting (a bad option, an empty token file, no token beyond loopback, a
snapshot that cannot be written, an address in use) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from hicache_storage.errors import ConfigError, HiCacheError

__all__ = ["metadata_server_command"]

_TOKEN_ENV = "THREEFS_METADATA_TOKEN"


class _OneLineCommand(click.Command):
    """A command whose usage errors are one line on stderr (``error: ...``) and exit status 2."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """Parse ``args``; report a usage error in one line instead of click's usage block."""
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            raise click.exceptions.Exit(2) from None


def _read_token(token_file: Path | None) -> str | None:
    """Return the token from ``token_file``, else from ``$THREEFS_METADATA_TOKEN``, else None."""
    from hicache_storage.backends.threefs.metadata_server import check_token

    if token_file is None:
        return check_token(os.environ.get(_TOKEN_ENV), f"${_TOKEN_ENV}")
    try:
        text = token_file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--token-file {token_file} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"cannot read --token-file {token_file}: {exc.strerror or exc}") from None
    return check_token(text, f"--token-file {token_file}")


@click.command("metadata-server", cls=_OneLineCommand)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=18000, show_default=True)
@click.option(
    "--token-file",
    type=click.Path(path_type=Path),
    help=f"File holding the bearer token clients must send (else ${_TOKEN_ENV}).",
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    help="Listen on an address other than loopback without a token (anyone can use the map).",
)
@click.option(
    "--snapshot",
    type=click.Path(path_type=Path),
    help="Persist to this snapshot file (and a .journal beside it); restored at start.",
)
@click.option(
    "--lease-s",
    type=click.FloatRange(min=0.1, max=86400.0),
    default=30.0,
    show_default=True,
    help="Seconds a writer may hold reserved slots before they are reclaimed.",
)
@click.option(
    "--client-timeout-s",
    type=click.FloatRange(min=0.1, max=3600.0),
    default=15.0,
    show_default=True,
    help="Seconds a client has to send a request's headers, and again its body; idle "
    "connections are closed after as long.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1, max=1_000_000),
    default=4096,
    show_default=True,
    help="Connections open at once; past it the oldest not yet authorized is closed.",
)
def metadata_server_command(
    host: str,
    port: int,
    token_file: Path | None,
    insecure_no_auth: bool,
    snapshot: Path | None,
    lease_s: float,
    client_timeout_s: float,
    max_connections: int,
) -> None:
    """Serve the 3FS backend's metadata (slot allocation, key map, LRU) over HTTP.

    Without --snapshot the map lives in memory: a restart forgets every key (readers miss) and
    refuses writes for one lease. An address other than loopback needs a token (or
    --insecure-no-auth).
    """
    try:
        from hicache_storage.backends.threefs.metadata_server import Limits, serve

        serve(
            host=host,
            port=port,
            token=_read_token(token_file),
            snapshot=str(snapshot) if snapshot is not None else None,
            lease_s=lease_s,
            insecure_no_auth=insecure_no_auth,
            limits=Limits(client_timeout_s=client_timeout_s, max_connections=max_connections),
        )
    except HiCacheError as exc:
        click.echo(f"error: {exc}", err=True)
        raise click.exceptions.Exit(2) from None
