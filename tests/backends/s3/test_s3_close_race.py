"""``close()`` while threads are inside calls, against a real S3 server.

Before, ``close()`` shut the request pool under running batches, which then raised
``StopIteration`` (or ``RuntimeError`` from the pool) instead of answering.
"""

from __future__ import annotations

from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.conformance.checks.close_race import KEYS, _Race
from hicache_storage.errors import BackendClosedError
from hicache_storage.layers import ForwardingBackend


@pytest.mark.parametrize("stack", ["bare", "layered"])
def test_close_under_load_answers_or_raises_closed(s3_options: dict[str, Any], stack: str) -> None:
    try:
        for seed in range(3):
            layered = create_backend("s3", s3_options)
            instance = layered
            if stack == "bare" and isinstance(layered, ForwardingBackend):
                instance = layered.unwrap()
            keys = [f"k{seed}-{i}" for i in range(KEYS)]
            race = _Race(instance, keys, seed=seed)
            race.prepare()
            assert race.run(layered.close) == []
            with pytest.raises(BackendClosedError):
                instance.batch_exists(keys)
    finally:
        with create_backend("s3", s3_options) as owner:
            owner.clear()
