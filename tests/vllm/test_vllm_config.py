"""Bad tier configs fail vLLM's start-up with one clear error."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.integrations.vllm import harness


def start(model: Path, tier: dict[str, Any], **kwargs: Any) -> None:
    with harness.engine(model, harness.kv_transfer_config(tier), **kwargs):
        pass


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"backend": "no-such-backend"}, "no-such-backend"),
        ({"options": {"url": "redis://127.0.0.1:6379/0"}}, "names no 'backend'; it is required"),
        ({"backend": "file", "options": {"root": "/tmp/x", "nope": 1}}, "nope"),
        ({"backend": "file", "options": {}}, "root"),
        ({"backend": "memory", "colour": "blue"}, "unknown key(s) ['colour']"),
        ({"backend": "memory", "deployment": {"tp_size": 2}}, "takes no 'deployment'"),
        ({"backend": "memory", "read_threads": 0}, "read_threads"),
    ],
)
def test_bad_tier_config_fails_start_up(model: Path, tier: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=re.escape(message)) as info:
        start(model, tier)
    assert type(info.value).__module__.startswith("hicache_storage"), repr(info.value)


def test_missing_extra_names_it(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As if redis-py were not installed: the backend module imports it again, and fails.
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "hicache_storage.backends.redis.backend", raising=False)
    with pytest.raises(Exception, match=r"hicache-storage\[redis\]"):
        start(model, {"backend": "redis", "options": {"url": "redis://127.0.0.1:1/0"}})


def test_unstable_block_hashes_are_refused(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(Exception, match="PYTHONHASHSEED"):
        start(model, {"backend": "memory"}, prefix_caching_hash_algo="xxhash")
