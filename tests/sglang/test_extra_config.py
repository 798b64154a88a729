"""The SGLang adapter: extra config that is not plain JSON is a ``ConfigError``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.sglang import config_from

from .helpers import storage_config


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def test_a_utf16_config_file_reads(tmp_path: Path) -> None:
    path = tmp_path / "hicache.json"
    path.write_bytes(json.dumps({"backend": "memory"}).encode("utf-16"))
    assert config_from(storage_config({"config": f"@{path}"})).backend == "memory"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"config": '{"backend": ' + "[" * 100_000 + "]" * 100_000 + "}"}, "nested deeper"),
        ({"config": '{"options": {"x": ' + "9" * 5000 + "}}"}, "integer of more than"),
        ({"backend": "memory", "deployment": {"tp_rank": _nested(100_000)}}, "nested deeper"),
        ({"backend": "memory", "deployment": {"tp_rank": 10**5000}}, "integer of"),
        ({"backend": "memory", "options": {"x": _nested(100_000)}}, "nested deeper"),
    ],
    ids=["deep-json", "huge-int-json", "deep-rank", "huge-rank", "deep-options"],
)
def test_bad_extra_config_input_is_a_config_error(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from(storage_config(extra))
