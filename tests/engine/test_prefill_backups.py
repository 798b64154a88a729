"""Write-through backs a prompt up as its prefill ends, not at its release (TierCache.prefilled)."""

from __future__ import annotations

import pytest

from hicache_storage.engine.cache import TierCache
from hicache_storage.engine.cache_config import WriteConfig
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import WritePolicy
from hicache_storage.engine.radix import Tier
from hicache_storage.engine.scheduler import Request, RequestState, Scheduler

from ._child import CONFIG, PAGE, build_cache

NEW = 6
PROMPT = [5 + (i * 7) % (CONFIG.vocab_size - 5) for i in range(5 * PAGE + 1)]
"""Five whole pages and one token."""


def step_until_decoding(scheduler: Scheduler, *requests: Request) -> None:
    for _ in range(50):
        if all(r.state is RequestState.DECODE for r in requests):
            return
        scheduler.step()
    pytest.fail("the prefills never ended")


def drive(scheduler: Scheduler) -> None:
    for _ in range(200):
        if scheduler.idle:
            return
        scheduler.step()
    pytest.fail("the scheduler never became idle")


def prompt_on_host(cache: TierCache, tokens: list[int]) -> int:
    """Leading tokens of ``tokens`` whose nodes hold a host copy."""
    match = cache.tree.match_prefix(tokens, touch=False)
    held = 0
    for node in cache.tree.path(match.device_node):
        if node.is_root:
            continue
        if Tier.HOST not in node.tiers:
            break
        held += node.num_tokens
    return held


def assert_sound(cache: TierCache) -> None:
    """The tree's invariants hold, nothing is locked and no device slot is lost or shared."""
    cache.tree.check()
    assert cache.tree.locked_tokens == 0
    free = cache.device_alloc.available_size()
    assert free + cache.tree.tokens_on(Tier.DEVICE) == cache.device_pool.size


def test_write_through_backs_the_prompt_up_while_the_request_decodes(model: LlamaModel) -> None:
    cache = build_cache(256, 256, None)
    scheduler = Scheduler(model, cache)
    request = scheduler.submit(Request(list(PROMPT), NEW))
    step_until_decoding(scheduler, request)
    whole = len(PROMPT) // PAGE * PAGE
    assert request in scheduler.running, "still decoding"
    assert prompt_on_host(cache, PROMPT) == whole, "the prompt's pages are on the host already"
    assert cache.stats.pages_backed_up == whole // PAGE
    assert cache.tree.locked_tokens >= whole, "its pages stay locked while it runs"
    drive(scheduler)
    assert request.output == model.generate_no_cache(PROMPT, NEW)
    assert_sound(cache)
    held = [*PROMPT, *request.output][: len(PROMPT) + NEW - 1]
    assert prompt_on_host(cache, held) == len(held) // PAGE * PAGE, "its release adds the rest"


@pytest.mark.parametrize(
    "policy", [WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH_SELECTIVE], ids=lambda p: p.value
)
def test_other_write_policies_insert_at_release(model: LlamaModel, policy: WritePolicy) -> None:
    cache = build_cache(256, 256, None, write=WriteConfig(policy))
    scheduler = Scheduler(model, cache)
    request = scheduler.submit(Request(list(PROMPT), NEW))
    step_until_decoding(scheduler, request)
    assert cache.tree.tokens_on(Tier.DEVICE) == 0 and cache.stats.pages_backed_up == 0
    drive(scheduler)
    assert request.output == model.generate_no_cache(PROMPT, NEW)
    assert cache.tree.tokens_on(Tier.DEVICE) > 0
    assert_sound(cache)


def test_a_request_failing_after_its_prefill_leaves_its_prompt_pages_sound(
    model: LlamaModel,
) -> None:
    cache = build_cache(256, 256, None)
    scheduler = Scheduler(model, cache)
    request = scheduler.submit(Request(list(PROMPT), NEW))
    step_until_decoding(scheduler, request)
    scheduler.fail(request, RuntimeError("the client went away"))
    assert request.state is RequestState.FAILED
    assert_sound(cache)
    again = scheduler.submit(Request(list(PROMPT), NEW))
    drive(scheduler)
    assert again.device_hit == len(PROMPT) // PAGE * PAGE, "the prompt's pages were kept"
    assert again.output == model.generate_no_cache(PROMPT, NEW)
    assert_sound(cache)


def test_one_prompt_computed_twice_at_once_keeps_one_copy_and_frees_the_other(
    model: LlamaModel,
) -> None:
    cache = build_cache(256, 256, None)
    scheduler = Scheduler(model, cache)
    first = scheduler.submit(Request(list(PROMPT), NEW))
    second = scheduler.submit(Request(list(PROMPT), NEW))
    step_until_decoding(scheduler, first, second)
    assert first.device_hit == second.device_hit == 0, "both computed the prompt"
    whole = len(PROMPT) // PAGE * PAGE
    assert cache.tree.tokens_on(Tier.DEVICE) == whole, "the tree took one request's pages"
    drive(scheduler)
    expected = model.generate_no_cache(PROMPT, NEW)
    assert first.output == second.output == expected
    assert_sound(cache)


def test_a_request_that_finishes_in_its_prefill_step_is_inserted_once(model: LlamaModel) -> None:
    cache = build_cache(256, 256, None)
    scheduler = Scheduler(model, cache)
    request = scheduler.submit(Request(list(PROMPT), 1))
    drive(scheduler)
    assert request.state is RequestState.FINISHED
    assert request.output == model.generate_no_cache(PROMPT, 1)
    assert cache.stats.pages_backed_up == len(PROMPT) // PAGE
    assert_sound(cache)
