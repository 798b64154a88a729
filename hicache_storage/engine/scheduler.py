"""Continuous batching over the tier cache: a queue, chunked prefill, batched decode, admission.

Each :meth:`Scheduler.step` is one forward of the model:

1. apply the storage threads' completions (:meth:`TierCache.poll`);
2. admit waiting requests in arrival order while the device pool has room for the whole request
   (its prompt and every token it may generate, so a running request is never preempted) and the
   prefetch policy lets it go; a request still waiting for its prefetch lets later ones pass;
3. build one batch: a decode token for every generating request, then prompt chunks of the
   prefilling ones up to ``chunk_tokens`` (a long prompt takes several steps and never holds up
   decoding);
4. run the forward with the admitted requests' L2→L1 loads overlapped layer by layer;
5. record first tokens (TTFT) and outputs, and hand finished requests' KV back to the cache.

The cache supplies every admitted request's prefix, so a request computes only its uncached
suffix; the device pool bounds admission, so a workload larger than the device pool evicts.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hicache_storage.errors import ConfigError, HostPoolError

from .cache import Lease, Lookup, TierCache
from .model import LlamaModel, Segment, next_token

__all__ = ["Request", "RequestState", "Scheduler"]

_ids = itertools.count()


class RequestState(enum.Enum):
    """Where a request is; only ever moves forward."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and what happened to it.

    Parameters
    ----------
    prompt
        Token ids.
    max_new_tokens
        Tokens to generate greedily, at least 1.
    seed
        The request's cache namespace (``namespace_seed(extra_key, cache_salt)``).
    tag
        Anything the caller wants back (a workload turn).
    """

    prompt: Sequence[int]
    max_new_tokens: int
    seed: str | None = None
    tag: object = None
    rid: int = field(default_factory=lambda: next(_ids))
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    arrival: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    lookup: Lookup | None = field(default=None, repr=False)
    lease: Lease | None = field(default=None, repr=False)
    computed: int = 0

    @property
    def total_tokens(self) -> int:
        """Slots the request holds: the prompt and every generated token but the last."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the cache supplied."""
        return self.device_hit + self.host_hit + self.storage_hit

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival


class Scheduler:
    """Serve many requests at once with a :class:`LlamaModel` over a :class:`TierCache`.

    Parameters
    ----------
    model
        The model; its KV shape must match the cache's device pool.
    cache
        The tier cache (``CacheConfig(prefix_cache=False)`` for the no-reuse baseline).
    chunk_tokens
        Most new tokens in one forward (decode tokens and prompt chunks together).
    max_running
        Most requests admitted at once.
    clock
        Seconds, for arrival and TTFT stamps.
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: TierCache,
        *,
        chunk_tokens: int = 512,
        max_running: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        for name, value in (("chunk_tokens", chunk_tokens), ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.cache = cache
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.forwards = 0

    @property
    def idle(self) -> bool:
        """Whether no request is waiting or running."""
        return not self.waiting and not self.running

    def submit(self, request: Request, *, arrival: float | None = None) -> Request:
        """Queue ``request`` (stamped as arriving now unless ``arrival`` is given).

        Raises
        ------
        HostPoolError
            If the request could never fit in the device pool, or has nothing to generate.
        """
        if request.max_new_tokens < 1 or not request.prompt:
            raise HostPoolError("a request needs a prompt and at least one token to generate")
        page = self.cache.config.page_size
        need = -(-request.total_tokens // page) * page
        if need > self.cache.device_pool.size:
            raise HostPoolError(
                f"request {request.rid} needs {need} device slots; the pool has "
                f"{self.cache.device_pool.size}"
            )
        request.arrival = self.clock() if arrival is None else arrival
        request.lookup = self.cache.lookup(request.prompt, seed=request.seed)
        self.waiting.append(request)
        return request

    def step(self) -> list[Request]:
        """Admit, run one forward, and return the requests that finished in it."""
        self.cache.poll()
        self._admit()
        if not self.running:
            return []
        batch = self._batch()
        load = self.cache.take_load()
        logits = self.model.forward(
            [segment for _, segment, _ in batch],
            self.cache.device_pool,
            layer_ready=None if load is None else load.wait,
        )
        tokens = [next_token(row) for row in logits]
        if load is not None:
            self.cache.record_load(load.timing())
        self.forwards += 1
        now = self.clock()
        finished: list[Request] = []
        for (request, _, chunk), token in zip(batch, tokens, strict=True):
            if request.state is RequestState.PREFILL:
                request.computed += chunk
                if request.computed < len(request.prompt):
                    continue
                request.first_token_at = now
                request.state = RequestState.DECODE
            request.output.append(token)
            if len(request.output) >= request.max_new_tokens:
                finished.append(request)
        for request in finished:
            self._finish(request, now)
        return finished

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while not self.idle:
            if not self.step() and not self.running:
                time.sleep(0.001)

    def close(self) -> None:
        """Drop waiting requests (their prefetches are stopped); running ones are released."""
        load = self.cache.take_load()
        if load is not None:  # slots the tree already counts as loaded must hold their KV
            load.finish()
        while self.waiting:
            request = self.waiting.popleft()
            if request.lookup is not None:
                self.cache.cancel(request.lookup)
        for request in self.running:
            lease = request.lease
            if lease is not None and not lease.released:
                self.cache.release(lease, request.prompt[: lease.cached], lease.slots)
        self.running.clear()

    # -- internals --------------------------------------------------------------------------------

    def _admit(self) -> None:
        admitted: list[Request] = []
        for request in self.waiting:
            if len(self.running) + len(admitted) >= self.max_running:
                break
            lookup = request.lookup
            assert lookup is not None
            self.cache.recheck(lookup)
            if not self.cache.ready(lookup):
                continue
            lease = self.cache.acquire(lookup, request.total_tokens)
            if lease is None:
                break
            request.lease = lease
            request.computed = lease.cached
            request.device_hit = lease.device_hit
            request.host_hit = lease.host_hit
            request.storage_hit = lease.storage_hit
            request.state = RequestState.PREFILL
            request.admitted_at = self.clock()
            admitted.append(request)
        for request in admitted:
            self.waiting.remove(request)
        self.running.extend(admitted)

    def _batch(self) -> list[tuple[Request, Segment, int]]:
        """Return the forward's work: a decode token per generating request, then prompt chunks.

        Prefilling requests share what ``chunk_tokens`` leaves after the decode tokens, in
        admission order (at least one token a step, so a prefill always progresses).
        """
        device = self.model.device
        budget = self.chunk_tokens - sum(r.state is RequestState.DECODE for r in self.running)
        budget = max(budget, 1)
        batch: list[tuple[Request, Segment, int]] = []
        for request in self.running:
            lease = request.lease
            assert lease is not None
            slots = lease.slots.to(self.cache.device_pool.device)
            if request.state is RequestState.DECODE:
                ctx = len(request.prompt) + len(request.output)
                last = torch.tensor(request.output[-1:], dtype=torch.int64, device=device)
                batch.append((request, Segment(last, slots[:ctx]), 1))
                continue
            n = min(len(request.prompt) - request.computed, budget)
            if n <= 0:
                continue
            budget -= n
            end = request.computed + n
            new = torch.tensor(request.prompt[request.computed : end], dtype=torch.int64)
            batch.append((request, Segment(new.to(device), slots[:end]), n))
        return batch

    def _finish(self, request: Request, now: float) -> None:
        lease = request.lease
        assert lease is not None
        held = [*request.prompt, *request.output][: request.total_tokens]
        self.cache.release(lease, held, lease.slots)
        request.state = RequestState.FINISHED
        request.finished_at = now
        self.running.remove(request)
