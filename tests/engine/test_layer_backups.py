"""Write-through backups that ride the forward: copied layer by layer, taken by the tree at release.

The copies are checked by what they serve: a host hit computes on them, so a copy of the wrong
slots, of a layer not yet written or of a failed forward would change the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import CacheConfig, TransferConfig, WriteConfig
from hicache_storage.engine.engine import Engine
from hicache_storage.engine.model import LlamaModel, Segment
from hicache_storage.engine.policies import WritePolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, Scheduler

from ._child import CONFIG, build_cache
from .test_scheduler import NEW, assert_clean, distinct_prompts, drive, oracle

RIDE = TransferConfig(layer_backups=True)
"""Backups that ride the forward (off by default)."""


def host_held(cache: TierCache) -> int:
    """Host slots in use that the tree does not account for (0 unless some leaked)."""
    pool = cache.host_pool
    assert pool is not None
    used = pool.size - pool.allocator.available_size()
    return used - cache.tree.tokens_on(Tier.HOST)


def serve_twice(model: LlamaModel, cache: TierCache, prompts: list[list[int]]) -> list[list[int]]:
    """Serve ``prompts`` together, then each again one by one (the device holds one at a time)."""
    with Engine(model, cache) as engine:
        first = engine.serve([Request(p, NEW) for p in prompts])
        again = [engine.generate(p, NEW) for p in prompts]
    return [r.output for r in first] + again


@pytest.mark.parametrize("riding", [True, False])
def test_host_hits_compute_on_the_ridden_copies(model: LlamaModel, riding: bool) -> None:
    prompts = distinct_prompts(3, 40, seed=11)
    cache = build_cache(96, 512, None, transfer=TransferConfig(layer_backups=riding))
    outputs = serve_twice(model, cache, prompts)
    assert outputs == oracle(model, prompts) * 2
    stats = cache.stats
    assert stats.host_hit_tokens > 0, "the second round read the host copies"
    if riding:
        assert stats.pages_backed_up_by_layer > 0
        pages = len(prompts) * (40 // cache.config.page_size)
        assert stats.pages_backed_up_by_layer == pages, "every prompt page, once"
    else:
        assert stats.pages_backed_up_by_layer == 0 and stats.pages_backed_up > 0
    assert host_held(cache) == 0, "every ridden slot a node did not take went back"
    assert_clean(cache)


def test_only_write_through_rides_the_forward(model: LlamaModel) -> None:
    prompts = distinct_prompts(3, 40, seed=12)
    for policy in (WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH_SELECTIVE):
        cache = build_cache(96, 512, None, write=WriteConfig(policy), transfer=RIDE)
        assert serve_twice(model, cache, prompts) == oracle(model, prompts) * 2
        assert cache.stats.pages_backed_up_by_layer == 0
        assert host_held(cache) == 0


def test_each_layer_is_copied_once_after_the_forward_wrote_it(model: LlamaModel) -> None:
    """The copies of layer i are queued after layer i's KV writes and before layer i + 1's."""
    cache = build_cache(96, 512, None, transfer=RIDE)
    events: list[str] = []
    transfer = cache.transfer
    assert transfer is not None
    backup = transfer.backup

    def recording_backup(*args: Any, layer: int | None = None, **kwargs: Any) -> None:
        events.append(f"copy {layer}")
        backup(*args, layer=layer, **kwargs)

    transfer.backup = recording_backup  # type: ignore[method-assign]
    forward = model.forward

    def recording_forward(segments: Sequence[Segment], pool: Any, **kwargs: Any) -> Any:
        ready = kwargs["layer_ready"]

        def hook(layer: int) -> None:
            events.append(f"layer {layer}")
            ready(layer)

        return forward(segments, pool, **{**kwargs, "layer_ready": hook})

    scheduler = Scheduler(model, cache)
    model.forward = recording_forward  # type: ignore[method-assign]
    try:
        (prompt,) = distinct_prompts(1, 40, seed=13)
        request = scheduler.submit(Request(prompt, 1))
        drive(scheduler)
    finally:
        del model.forward  # type: ignore[method-assign]
    assert request.output == oracle(model, [prompt], 1)[0]
    layers = CONFIG.layers
    expected = ["layer 0"]
    for layer in range(1, layers):
        expected += [f"layer {layer}", f"copy {layer - 1}"]
    expected.append(f"copy {layers - 1}")
    assert events[: len(expected)] == expected
    assert [e for e in events if e.startswith("copy")] == [f"copy {i}" for i in range(layers)]
    cache.close()


def test_a_failed_forward_attaches_none_of_its_copies(model: LlamaModel) -> None:
    """A batched forward that fails after writing some layers: its copies are given back, the
    requests recompute one by one, and what the host later serves is the recomputed KV."""
    prompts = distinct_prompts(2, 40, seed=14)
    cache = build_cache(96, 512, None, transfer=RIDE)
    scheduler = Scheduler(model, cache)
    forward = model.forward
    failed: list[int] = []

    def failing_forward(segments: Sequence[Segment], pool: Any, **kwargs: Any) -> Any:
        ready = kwargs.get("layer_ready")
        if not failed and len(segments) > 1 and ready is not None:
            failed.append(1)
            for layer in range(CONFIG.layers - 1):
                ready(layer)  # the copies of the layers before are queued
            for layer in range(CONFIG.layers):  # and what they copy is garbage
                pool.buffers[0][layer].normal_()
                pool.buffers[1][layer].normal_()
            raise RuntimeError("injected forward failure")
        return forward(segments, pool, **kwargs)

    model.forward = failing_forward  # type: ignore[method-assign]
    try:
        requests = [scheduler.submit(Request(p, NEW)) for p in prompts]
        drive(scheduler)
    finally:
        del model.forward  # type: ignore[method-assign]
    assert failed, "the batched forward ran and failed"
    assert [r.output for r in requests] == oracle(model, prompts)
    assert cache.stats.pages_backed_up_by_layer == 0, "no copy of the failed forward was taken"
    assert host_held(cache) == 0
    others = distinct_prompts(4, 40, seed=24)[2:]
    with Engine(model, cache) as engine:  # others evict them from the device: host hits
        again = [engine.generate(p, NEW) for p in [*others, *prompts]]
    assert again == oracle(model, [*others, *prompts])
    assert cache.stats.host_hit_tokens > 0


def test_a_prompt_another_request_inserted_first_keeps_that_requests_copy(
    model: LlamaModel,
) -> None:
    """Two requests with one prompt in one forward: the tree keeps the first one's slots and
    copy; the second's copy goes back to the pool."""
    (prompt,) = distinct_prompts(1, 40, seed=15)
    cache = build_cache(160, 512, None, transfer=RIDE)
    scheduler = Scheduler(model, cache)
    requests = [scheduler.submit(Request(list(prompt), NEW)) for _ in range(2)]
    drive(scheduler)
    assert [r.output for r in requests] == oracle(model, [prompt]) * 2
    assert cache.stats.pages_backed_up_by_layer == 40 // cache.config.page_size
    assert host_held(cache) == 0
    assert_clean(cache)


def test_the_option_is_a_checked_bool_off_by_default() -> None:
    with pytest.raises(Exception, match="layer_backups"):
        TransferConfig(layer_backups="yes")  # type: ignore[arg-type]
    assert CacheConfig(8).transfer.layer_backups is False


@pytest.mark.parametrize("riding", [False, True])
def test_with_a_storage_tier_the_ridden_copies_are_taken_too(
    model: LlamaModel, riding: bool
) -> None:
    prompts = distinct_prompts(3, 40, seed=16)
    store = create_backend("memory")
    cache = build_cache(96, 512, store, transfer=TransferConfig(layer_backups=riding))
    assert serve_twice(model, cache, prompts) == oracle(model, prompts) * 2
    if riding:
        assert cache.stats.pages_backed_up_by_layer > 0
        assert cache.stats.pages_stored > 0, "the ridden host copies are what is written"
    else:
        assert cache.stats.pages_backed_up_by_layer == 0
    assert host_held(cache) == 0
    store.close()
