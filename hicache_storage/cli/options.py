"""Backend options of ``hicache check`` and ``hicache bench``: validated, scratch by default."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import msgspec

from ..config import convert, read_source
from ..registry import get_spec

__all__ = ["backend_options"]


@contextlib.contextmanager
def backend_options(backend: str, config: str | None, prefix: str) -> Iterator[str | None]:
    """Yield the config source to run ``backend`` with, validated so mistakes exit 2 at once.

    Without ``config``, a backend whose options require a ``root`` directory or a ``path`` gets
    one in a fresh temporary directory (named ``prefix...``), removed afterwards.
    """
    schema = get_spec(backend).load_config_type()
    what = f"{backend} backend options"
    if config is not None:
        convert(read_source(config), schema, what)
        yield config
        return
    required = {field.name for field in msgspec.structs.fields(schema) if field.required}
    if not required & {"root", "path"}:
        yield None
        return
    scratch = tempfile.mkdtemp(prefix=prefix)
    try:
        options: dict[str, str] = {}
        if "root" in required:
            options["root"] = os.path.join(scratch, "root")
        if "path" in required:
            options["path"] = os.path.join(scratch, "store")
        source = msgspec.json.encode(options).decode()
        convert(read_source(source), schema, what)
        yield source
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
