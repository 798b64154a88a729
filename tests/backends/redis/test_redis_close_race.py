"""``close()`` while threads are inside calls, on a server and a cluster.

Before, ``close()`` disconnected the pools under running pipelines: calls raised redis-py's
``AttributeError`` / ``TypeError`` or a false ``BackendUnavailableError``.
"""

from __future__ import annotations

import pytest

from hicache_storage import create_backend
from hicache_storage.conformance.checks.close_race import KEYS, _Race
from hicache_storage.errors import BackendClosedError
from hicache_storage.kit.services import LocalService
from hicache_storage.layers import ForwardingBackend


@pytest.mark.parametrize("stack", ["bare", "layered"])
def test_close_under_load_answers_or_raises_closed(redis_service: LocalService, stack: str) -> None:
    options = {**redis_service.options, "prefix": f"close-{stack}:"}
    try:
        for seed in range(3):
            layered = create_backend("redis", options)
            instance = layered
            if stack == "bare" and isinstance(layered, ForwardingBackend):
                instance = layered.unwrap()
            keys = [f"k{seed}-{i}" for i in range(KEYS)]
            race = _Race(instance, keys, seed=seed)
            race.prepare()
            assert race.run(layered.close) == []
            with pytest.raises(BackendClosedError):
                instance.batch_get(keys, [bytearray(1)] * KEYS)
    finally:
        with create_backend("redis", options) as owner:
            owner.clear()
