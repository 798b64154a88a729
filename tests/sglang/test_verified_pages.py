"""SGLang's controller never loads a page the store claimed but did not deliver."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from hicache_storage import register_plugin, unregister_plugin

from .helpers import PAGE, controller, fill_random, make_pools, read_pages, set_rank
from .test_controllers import backup, prefetch


@pytest.fixture(autouse=True)
def broken_plugin() -> Iterator[None]:
    import tests.broken_backends.plugin as plugin

    set_rank()
    register_plugin(sys.modules[plugin.__name__], name=plugin.__name__)
    yield
    unregister_plugin(sys.modules[plugin.__name__])


def test_pages_claimed_but_not_filled_are_misses_to_sglang() -> None:
    pools = make_pools("mha", "page_first")
    cc = controller(pools, {"backend": "broken-claims-unfilled", "options": {"store": "sgl"}})
    tokens = list(range(3 * PAGE))
    src = pools.host.alloc(len(tokens))
    fill_random(pools.host, src, seed=5)
    assert backup(cc, src, tokens) == len(tokens)
    loaded, _ = prefetch(cc, pools.host, tokens)
    assert loaded == 0, "SGLang loaded pages whose bytes were never delivered"
    assert cc.storage_backend.backend.stats()["verify"]["mismatched"] > 0
    cc.detach_storage_backend()


def test_verified_pages_load_byte_identical() -> None:
    pools = make_pools("mha", "page_first")
    cc = controller(pools, {"backend": "memory"})
    tokens = list(range(3 * PAGE))
    src = pools.host.alloc(len(tokens))
    pages = fill_random(pools.host, src, seed=6)
    assert backup(cc, src, tokens) == len(tokens)
    loaded, dst = prefetch(cc, pools.host, tokens)
    assert loaded == len(tokens)
    assert all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, dst), pages, strict=True))
    assert cc.storage_backend.backend.stats()["verify"]["verified"] == 3
    cc.detach_storage_backend()
