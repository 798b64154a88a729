"""The engine's model: attending over a paged device pool gives what recomputing everything gives.

The property the KV cache relies on: a prompt prefilled in one go, or prefilled from a prefix whose
KV sits in the pool (at any slots, written by an earlier forward or copied from elsewhere), gives
the same logits up to float rounding and the same greedy tokens as the no-cache oracle. Every pool
starts poisoned with NaN, so a forward that reads a slot it should not (or one never written)
fails loudly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from hicache_storage.engine.model import (
    GRAPH_TOKENS,
    LlamaModel,
    ModelConfig,
    Segment,
    next_token,
)
from hicache_storage.errors import ConfigError, HostPoolError, InvalidValueError
from hicache_storage.kernels import DevicePool

PAGE = 8
NEW_TOKENS = 16
POOL_SIZE = 160
ATOL = RTOL = 1e-4
KV_HEADS = {"mha": 4, "gqa": 2}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run on one thread: shapes this small gain nothing from more, which would only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(KV_HEADS), ids=list(KV_HEADS))
def model(request: pytest.FixtureRequest) -> LlamaModel:
    return LlamaModel(ModelConfig.tiny(kv_heads=KV_HEADS[request.param], seed=7))


def make_pool(config: ModelConfig, size: int) -> DevicePool:
    return DevicePool.mha(size, config.layers, config.kv_heads, config.head_dim, config.dtype)


def poisoned_pool(model: LlamaModel) -> DevicePool:
    pool = make_pool(model.config, POOL_SIZE)
    for part in pool.buffers:
        for tensor in part:
            tensor.fill_(float("nan"))
    return pool


def random_tokens(count: int, seed: int, vocab: int = 512) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=generator).tolist()


def shuffled_slots(count: int, seed: int) -> torch.Tensor:
    """``count`` distinct, non-contiguous slots in random order."""
    return torch.randperm(POOL_SIZE, generator=torch.Generator().manual_seed(seed))[:count]


def segment(tokens: list[int], slots: torch.Tensor) -> Segment:
    return Segment(torch.tensor(tokens, dtype=torch.int64), slots)


def all_logits(
    model: LlamaModel, pool: DevicePool, tokens: list[int], slots: torch.Tensor
) -> torch.Tensor:
    """Compute ``tokens``, the last of a context whose slots are ``slots``; return their logits."""
    return model.forward([segment(tokens, slots)], pool, all_logits=True)[0]


@pytest.mark.parametrize("cached_pages", [1, 3])
def test_prefix_cached_prefill_matches_full_and_no_cache(
    model: LlamaModel, cached_pages: int
) -> None:
    prompt = random_tokens(3 * PAGE + 5, seed=cached_pages)
    cached = cached_pages * PAGE
    oracle = model.forward_no_cache(torch.tensor(prompt))

    whole_pool = poisoned_pool(model)
    whole = all_logits(model, whole_pool, prompt, shuffled_slots(len(prompt), seed=1))

    pool = poisoned_pool(model)
    slots = shuffled_slots(len(prompt) + NEW_TOKENS, seed=2)
    prefix = all_logits(model, pool, prompt[:cached], slots[:cached])
    suffix = all_logits(model, pool, prompt[cached:], slots[: len(prompt)])

    chunked = torch.cat([prefix, suffix])
    assert chunked.shape == (len(prompt), model.config.vocab_size)
    torch.testing.assert_close(chunked, oracle, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(whole, oracle, atol=ATOL, rtol=RTOL)

    # The prompt's KV stays in the pool: generating on from it matches recomputing everything.
    expected = model.generate_no_cache(prompt, NEW_TOKENS)
    assert model.generate(prompt, NEW_TOKENS, pool, slots, cached=len(prompt) - 1) == expected


def test_prefix_copied_to_other_slots_of_another_pool(model: LlamaModel) -> None:
    """KV depends on a token's position, never on its slot: a loaded prefix may land anywhere."""
    prompt = random_tokens(2 * PAGE + 3, seed=11)
    cached = 2 * PAGE
    source, target = poisoned_pool(model), poisoned_pool(model)
    source_slots = shuffled_slots(cached, seed=3)
    target_slots = shuffled_slots(len(prompt) + NEW_TOKENS, seed=4)
    all_logits(model, source, prompt[:cached], source_slots)
    for src, dst in zip(source.buffers, target.buffers, strict=True):
        for layer_src, layer_dst in zip(src, dst, strict=True):
            layer_dst[target_slots[:cached]] = layer_src[source_slots]

    suffix = all_logits(model, target, prompt[cached:], target_slots[: len(prompt)])
    oracle = model.forward_no_cache(torch.tensor(prompt))
    torch.testing.assert_close(suffix, oracle[cached:], atol=ATOL, rtol=RTOL)
    expected = model.generate_no_cache(prompt, NEW_TOKENS)
    assert model.generate(prompt, NEW_TOKENS, target, target_slots, cached=cached) == expected


def test_decode_step_by_step_through_the_pool(model: LlamaModel) -> None:
    prompt = random_tokens(PAGE + 1, seed=21)
    pool = poisoned_pool(model)
    slots = shuffled_slots(len(prompt) + NEW_TOKENS, seed=5)
    steps = [model.forward([segment(prompt, slots[: len(prompt)])], pool)[0]]
    seq = [*prompt, next_token(steps[-1])]
    for _ in range(NEW_TOKENS - 1):
        steps.append(model.forward([segment(seq[-1:], slots[: len(seq)])], pool)[0])
        seq.append(next_token(steps[-1]))

    oracle = model.forward_no_cache(torch.tensor(seq[:-1]))[len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(steps), oracle, atol=ATOL, rtol=RTOL)
    assert seq[len(prompt) :] == model.generate_no_cache(prompt, NEW_TOKENS)
    assert model.generate(prompt, NEW_TOKENS, poisoned_pool(model), slots) == seq[len(prompt) :]


def test_batch_of_segments_equals_each_alone(model: LlamaModel) -> None:
    """Requests of different prefix and new lengths share one forward; each gets its own logits."""
    prompts = [random_tokens(n, seed=30 + n) for n in (PAGE + 2, 3, 2 * PAGE + 1)]
    cached = [PAGE, 0, 2 * PAGE]
    slots = shuffled_slots(sum(map(len, prompts)), seed=6).split_with_sizes(
        [len(p) for p in prompts]
    )
    pool = poisoned_pool(model)
    for prompt, n, req_slots in zip(prompts, cached, slots, strict=True):
        if n:
            all_logits(model, pool, prompt[:n], req_slots[:n])
    batch = [segment(p[n:], s) for p, n, s in zip(prompts, cached, slots, strict=True)]

    every = model.forward(batch, pool, all_logits=True)
    last = model.forward(batch, pool)

    for prompt, n, got, got_last in zip(prompts, cached, every, last, strict=True):
        oracle = model.forward_no_cache(torch.tensor(prompt))
        torch.testing.assert_close(got, oracle[n:], atol=ATOL, rtol=RTOL)
        assert got_last.shape == (model.config.vocab_size,)
        torch.testing.assert_close(got_last, got[-1], atol=ATOL, rtol=RTOL)


def test_decodes_of_different_contexts_batched_around_a_prefill_equal_the_oracle(
    model: LlamaModel,
) -> None:
    """Consecutive one-token segments attend in one call; short contexts are padded and masked."""
    lengths = (PAGE + 3, 2, 3 * PAGE, PAGE, 2 * PAGE + 5, 7)
    prompts = [random_tokens(n, seed=50 + n) for n in lengths]
    slots = shuffled_slots(sum(lengths), seed=9).split_with_sizes(list(lengths))
    new = [1, 1, 4, 1, 1, 1]  # decode, decode, a prefill of 4, three decodes
    pool = poisoned_pool(model)
    for prompt, n, req_slots in zip(prompts, new, slots, strict=True):
        if len(prompt) > n:
            all_logits(model, pool, prompt[:-n], req_slots[: len(prompt) - n])
    batch = [segment(p[-n:], s) for p, n, s in zip(prompts, new, slots, strict=True)]

    every = model.forward(batch, pool, all_logits=True)

    for prompt, n, got in zip(prompts, new, every, strict=True):
        oracle = model.forward_no_cache(torch.tensor(prompt))
        torch.testing.assert_close(got, oracle[-n:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("new", [1, 3, 5, 64, GRAPH_TOKENS[-1]])
def test_static_buffers_padded_to_a_graph_size_give_the_eager_logits(
    model: LlamaModel, new: int
) -> None:
    """The CUDA-graph path's buffers and padding (run without graphs on a CPU) change nothing."""
    padded = LlamaModel(model.config, graphs=True)
    size = 2 * GRAPH_TOKENS[-1] + 8
    prompt = random_tokens(PAGE + new, seed=60 + new)

    def run(m: LlamaModel) -> list[torch.Tensor]:
        pool = make_pool(m.config, size)
        slots = torch.randperm(size, generator=torch.Generator().manual_seed(new))[: len(prompt)]
        all_logits(m, pool, prompt[:PAGE], slots[:PAGE])
        decodes = [segment([prompt[i]], slots[: i + 1]) for i in range(2, 5)]
        batch = [*decodes[: new % 3], segment(prompt[PAGE:], slots)]
        # A size past the largest graph takes the eager path and must not disturb the buffers.
        long = random_tokens(size - 8, seed=1)
        m.forward([segment(long, torch.arange(size - 8))], make_pool(m.config, size))
        return m.forward(batch, pool, all_logits=True)

    eager, buffered = run(model), run(padded)
    for got, expected in zip(buffered, eager, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    oracle = model.forward_no_cache(torch.tensor(prompt))
    torch.testing.assert_close(buffered[-1], oracle[PAGE:], atol=ATOL, rtol=RTOL)


def test_forward_reads_the_prefix_from_the_pool(model: LlamaModel) -> None:
    """The tests above are not vacuous: one changed value in a prefix slot changes the logits."""
    prompt = random_tokens(PAGE + 4, seed=40)
    pool = poisoned_pool(model)
    slots = shuffled_slots(len(prompt), seed=7)
    all_logits(model, pool, prompt[:PAGE], slots[:PAGE])
    before = all_logits(model, pool, prompt[PAGE:], slots)
    pool.buffers[1][model.config.layers - 1][slots[2]] += 1.0
    after = all_logits(model, pool, prompt[PAGE:], slots)
    assert (after - before).abs().max() > 100 * ATOL


def test_layer_ready_runs_once_per_layer_in_order_before_its_attention() -> None:
    """The hook plays the loader: each layer's prefix KV lands only when the hook runs for it."""
    model = LlamaModel(ModelConfig.tiny(layers=4, kv_heads=1, seed=3))  # MQA
    layers = model.config.layers
    prompts = [random_tokens(2 * PAGE + 3, seed=50), random_tokens(PAGE + 2, seed=51)]
    cached = [2 * PAGE, PAGE]
    slots = shuffled_slots(sum(map(len, prompts)), seed=8).split_with_sizes(
        [len(p) for p in prompts]
    )
    pool = poisoned_pool(model)
    for prompt, n, req_slots in zip(prompts, cached, slots, strict=True):
        all_logits(model, pool, prompt[:n], req_slots[:n])
    prefix_slots = torch.cat([s[:n] for s, n in zip(slots, cached, strict=True)])
    new_slots = torch.cat([s[n:] for s, n in zip(slots, cached, strict=True)])
    saved = [[layer[prefix_slots].clone() for layer in part] for part in pool.buffers]
    for part in pool.buffers:
        for layer in part:
            layer[prefix_slots] = float("nan")

    calls: list[int] = []

    def load(layer: int) -> None:
        # Layers before this one have written their new KV; this one and later ones have not.
        for seen in range(layers):
            written = bool(pool.buffers[0][seen][new_slots].isfinite().all())
            assert written == (seen < layer), (layer, seen)
        calls.append(layer)
        for part, kept in zip(pool.buffers, saved, strict=True):
            part[layer][prefix_slots] = kept[layer]

    batch = [segment(p[n:], s) for p, n, s in zip(prompts, cached, slots, strict=True)]
    got = model.forward(batch, pool, layer_ready=load, all_logits=True)

    assert calls == list(range(layers))
    for prompt, n, logits in zip(prompts, cached, got, strict=True):
        oracle = model.forward_no_cache(torch.tensor(prompt))
        torch.testing.assert_close(logits, oracle[n:], atol=ATOL, rtol=RTOL)


def test_attention_never_runs_on_cudnn_and_the_process_choice_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuDNN builds a plan for each new shape (a serving engine meets one nearly every step)."""
    model = LlamaModel(ModelConfig.tiny(layers=2))
    pool = poisoned_pool(model)
    real = torch.nn.functional.scaled_dot_product_attention
    seen: list[tuple[bool, bool, bool]] = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        backends = torch.backends.cuda
        seen.append(
            (
                backends.cudnn_sdp_enabled(),
                backends.flash_sdp_enabled(),
                backends.mem_efficient_sdp_enabled(),
            )
        )
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prompt = random_tokens(PAGE + 3, seed=60)
    slots = shuffled_slots(len(prompt) + 2, seed=9)
    torch.backends.cuda.enable_cudnn_sdp(True)
    out = model.generate(prompt, 3, pool, slots)
    oracle = model.generate_no_cache(prompt, 3)

    assert out == oracle
    # prefill, two decodes and the oracle's three forwards, every layer of each
    assert len(seen) == 6 * model.config.layers
    assert set(seen) == {(False, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_forwards_overlapping_in_two_threads_keep_cudnn_off_until_the_last_one_ends() -> None:
    """Each forward putting back what it found would turn cuDNN on under the other, then off."""
    model = LlamaModel(ModelConfig.tiny(layers=2))
    pool = poisoned_pool(model)
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def first_waits(layer: int) -> None:
        if layer == 0:
            inside.set()
            assert release.wait(10)

    def second_outlives_first(layer: int) -> None:
        if layer == 0:  # the first forward ends while this one is in its first layer
            release.set()
            first.join(10)
            assert not first.is_alive()
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())

    torch.backends.cuda.enable_cudnn_sdp(True)
    slots = shuffled_slots(2 * PAGE, seed=10)
    prompt = random_tokens(PAGE, seed=61)
    first = threading.Thread(
        target=model.forward,
        args=([segment(prompt, slots[:PAGE])], pool),
        kwargs={"layer_ready": first_waits},
    )
    first.start()
    try:
        assert inside.wait(10)
        model.forward([segment(prompt, slots[PAGE:])], pool, layer_ready=second_outlives_first)
    finally:
        release.set()
        first.join(10)
    assert seen == [False] * model.config.layers
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_weights_are_seeded() -> None:
    config = ModelConfig.tiny()
    tokens = torch.tensor(random_tokens(PAGE, seed=60))
    first = LlamaModel(config).forward_no_cache(tokens)
    assert torch.equal(first, LlamaModel(config).forward_no_cache(tokens))
    other = LlamaModel(dataclasses.replace(config, seed=config.seed + 1)).forward_no_cache(tokens)
    assert not torch.allclose(first, other)


def test_many_layers_stay_finite() -> None:
    config = ModelConfig.tiny(layers=32, dtype=torch.bfloat16)
    logits = LlamaModel(config).forward_no_cache(torch.tensor(random_tokens(2 * PAGE, seed=61)))
    assert bool(logits.isfinite().all())
    assert 0.1 < float(logits.std()) < 10.0


def test_llama3_8b_shape() -> None:
    config = ModelConfig.llama3_8b()
    shape = (
        config.vocab_size,
        config.hidden,
        config.layers,
        config.heads,
        config.kv_heads,
        config.head_dim,
        config.intermediate,
    )
    assert shape == (128256, 4096, 32, 32, 8, 128, 14336)
    assert config.rope_theta == 500000.0
    assert config.rms_eps == 1e-5
    assert config.dtype == torch.bfloat16
    assert config.kv_bytes_per_token == 128 * 1024
    assert ModelConfig.llama3_8b(layers=2).layers == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"heads": 4, "kv_heads": 3}, r"heads \(4\) must be a multiple of kv_heads \(3\)"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"layers": 0}, "layers must be a positive integer"),
        ({"hidden": 64.0}, "hidden must be a positive integer"),
        ({"vocab_size": True}, "vocab_size must be a positive integer"),
        ({"rope_theta": 0.0}, "rope_theta must be a positive finite number"),
        ({"rms_eps": float("nan")}, "rms_eps must be a positive finite number"),
        ({"dtype": torch.int32}, "dtype must be a floating-point"),
    ],
)
def test_config_validation(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.tiny(**overrides)


def test_pool_that_does_not_fit_is_refused() -> None:
    model = LlamaModel(ModelConfig.tiny())
    c = model.config
    seg = segment([1, 2], torch.tensor([0, 1]))
    pools: list[Callable[[], DevicePool]] = [
        lambda: DevicePool.mha(8, c.layers + 1, c.kv_heads, c.head_dim, c.dtype),
        lambda: DevicePool.mha(8, c.layers, c.heads, c.head_dim, c.dtype),
        lambda: DevicePool.mha(8, c.layers, c.kv_heads, c.head_dim, torch.bfloat16),
        lambda: DevicePool.mla(8, c.layers, c.kv_heads * c.head_dim, c.dtype),
    ]
    for make in pools:
        with pytest.raises(HostPoolError, match="do not fit the model"):
            model.forward([seg], make())
    with pytest.raises(HostPoolError, match="at least one segment"):
        model.forward([], make_pool(c, 8))


def test_bad_segments_and_generate_arguments() -> None:
    model = LlamaModel(ModelConfig.tiny())
    pool = make_pool(model.config, 16)
    with pytest.raises(InvalidValueError, match="tokens must be a 1-D int64"):
        Segment(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1]))
    with pytest.raises(InvalidValueError, match="slots must be a 1-D int64"):
        Segment(torch.tensor([1, 2]), torch.tensor([[0, 1]]))
    with pytest.raises(HostPoolError, match="at least one new token"):
        Segment(torch.tensor([], dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(HostPoolError, match="only 1 context slots"):
        Segment(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(HostPoolError, match="at least one of the 3 prompt tokens"):
        model.generate([1, 2, 3], 2, pool, torch.arange(4), cached=3)
    with pytest.raises(HostPoolError, match="need 4 slots, got 3"):
        model.generate([1, 2, 3], 2, pool, torch.arange(3))
