"""``hicache metadata-server``: the key → slot map the 3FS backend's processes share."""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["metadata_server_command"]


@click.command("metadata-server")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=18000, show_default=True)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File holding the bearer token clients must send (else $THREEFS_METADATA_TOKEN).",
)
@click.option(
    "--snapshot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Persist to this snapshot file (and a .journal beside it); restored at start.",
)
@click.option(
    "--lease-s",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Seconds a writer may hold reserved slots before they are reclaimed.",
)
def metadata_server_command(
    host: str, port: int, token_file: Path | None, snapshot: Path | None, lease_s: float
) -> None:
    """Serve the 3FS backend's metadata (slot allocation, key map, LRU) over HTTP.

    Without --snapshot the map lives in memory: a restart forgets every key (readers miss) and
    refuses writes for one lease. Bind to another address than 127.0.0.1 only with a token.
    """
    import os

    from hicache_storage.backends.threefs.metadata_server import serve

    token = (
        token_file.read_text(encoding="utf-8").strip()
        if token_file is not None
        else os.environ.get("THREEFS_METADATA_TOKEN") or None
    )
    serve(
        host=host,
        port=port,
        token=token,
        snapshot=str(snapshot) if snapshot is not None else None,
        lease_s=lease_s,
    )
