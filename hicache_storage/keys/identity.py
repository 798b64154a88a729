"""A model's identity for stored KV: what its weights are and every setting that shapes its KV.

A model's name or path does not say what KV it computes: a new checkpoint copied over the old
one keeps the path, and one checkpoint served with another RoPE setting (vLLM's
``--hf-overrides``) keeps both name and weights. Stored KV is only valid for a reader whose
weights and KV-shaping settings are the writer's, so the key namespace carries
:func:`model_identity`: the model's base name, for people, and a digest of a
:func:`weights_fingerprint` and the :func:`kv_settings` of its config.

The weights are fingerprinted by sampling, not by hashing every byte: for each weight file its
relative name, its size and :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BYTES` at evenly spaced
offsets, the first and the last block included. A new checkpoint (fine-tuned, re-trained,
re-quantized) changes nearly every tensor, so every sampled block differs; the cost is at most
``SAMPLE_BLOCKS * SAMPLE_BYTES`` (1 MiB) read per file, whatever the checkpoint's size, so it can
run at every start. The digest does not depend on where the directory lies: copies of one
checkpoint on different hosts agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "KV_SETTINGS",
    "SAMPLE_BLOCKS",
    "SAMPLE_BYTES",
    "WEIGHT_SUFFIXES",
    "kv_settings",
    "local_snapshot",
    "model_identity",
    "weights_fingerprint",
]

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""File name endings of weight files; other files (tokenizer, config) do not change the KV."""

SAMPLE_BLOCKS = 16
"""Blocks read from each weight file, evenly spaced from the first to the last."""

SAMPLE_BYTES = 64 << 10
"""Size of a sampled block."""

KV_SETTINGS = (
    "rope_scaling",
    "rope_theta",
    "rope_parameters",
    "partial_rotary_factor",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "max_position_embeddings",
    "quantization_config",
    "head_dim",
    "num_key_value_heads",
    "hidden_size",
    "num_hidden_layers",
    "torch_dtype",
)
"""Config attributes that change the KV a model computes from given weights and tokens.

``max_position_embeddings`` is among them because some RoPE scalings (dynamic NTK, YaRN,
LongRoPE) derive their frequencies from it."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")
_NAME_LENGTH = 48


def _sampled(path: Path, size: int) -> list[bytes]:
    """Read the sampled blocks of one file: all of it when it is small, else evenly spaced."""
    with path.open("rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            return [f.read()]
        last = size - SAMPLE_BYTES
        blocks = []
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            blocks.append(f.read(SAMPLE_BYTES))
        return blocks


def _weight_files(root: Path) -> list[tuple[str, Path]]:
    """Return the weight files under ``root`` (or ``root`` itself), sorted by relative name."""
    if root.is_file():
        return [(root.name, root)]
    found = [
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*")
        if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file()
    ]
    return sorted(found)


def local_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """Return the Hugging Face cache's local snapshot of a hub id, if the hub client has one."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None


def weights_fingerprint(path: str | os.PathLike[str], revision: str | None = None) -> str:
    """Return a hex digest of a checkpoint's weights, sampled (see the module's docstring).

    ``path`` is a local model directory, a single weight file, or a hub id, which is looked up
    in the local Hugging Face cache. When no local weights are found (a hub id not downloaded
    yet), the digest covers only the name and ``revision`` and a warning says so: a checkpoint
    replaced under the same name and revision is then not told apart.
    """
    name = os.fspath(path)
    local = Path(name)
    root = local if local.exists() else local_snapshot(name, revision)
    digest = hashlib.blake2b(digest_size=16)
    files = _weight_files(root) if root is not None else []
    if not files:
        logger.warning(
            "no weight files found for model %r (revision %r): its stored KV is keyed by "
            "name and revision only, so a new checkpoint under this name would read the old "
            "one's KV",
            name,
            revision,
        )
        digest.update(json.dumps(["name", name, revision]).encode())
        return digest.hexdigest()
    for relative, file in files:
        size = file.stat().st_size
        digest.update(json.dumps(["file", relative, size]).encode())
        for block in _sampled(file, size):
            digest.update(block)
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """``value`` as JSON data: config objects as their dicts, dtypes and the like as text."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    return str(value).removeprefix("torch.")


def kv_settings(hf_config: Any) -> dict[str, Any]:
    """Return the ``KV_SETTINGS`` a Hugging Face config states, as sorted JSON data.

    ``hf_config`` is a ``transformers`` config object or its dict; settings it lacks (or sets
    to ``None``) are left out. A multimodal config's ``text_config`` is read as well, under
    ``text_config``.
    """

    def read(config: Any) -> dict[str, Any]:
        found = {}
        for name in KV_SETTINGS:
            value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
            if value is not None:
                found[name] = _plain(value)
        return found

    settings = read(hf_config)
    text = (
        hf_config.get("text_config")
        if isinstance(hf_config, Mapping)
        else getattr(hf_config, "text_config", None)
    )
    if text is not None and text is not hf_config:
        inner = read(text)
        if inner:
            settings["text_config"] = inner
    return json.loads(json.dumps(settings, sort_keys=True))  # type: ignore[no-any-return]


def model_identity(name: str, weights: str, settings: Mapping[str, Any]) -> str:
    """Return ``<base name>-<16 hex digits>``: the model's identity in keys and namespaces.

    The digest covers ``weights`` (a :func:`weights_fingerprint`) and ``settings`` (its
    :func:`kv_settings` and any other KV-shaping setting, such as a quantization method), not
    ``name``: the same checkpoint at two paths is one model. The base name (the last part of
    ``name``, characters outside the key alphabet replaced by ``-``) is for people reading keys.
    The result obeys the key rule and is at most 65 characters long.
    """
    record = json.dumps({"weights": weights, "settings": settings}, sort_keys=True, default=str)
    digest = hashlib.blake2b(record.encode(), digest_size=8).hexdigest()
    base = _UNSAFE.sub("-", os.path.basename(name.rstrip("/\\")) or "model")
    base = re.sub(r"\.{2,}", ".", base).lstrip("._-")[:_NAME_LENGTH] or "model"
    return f"{base}-{digest}"
