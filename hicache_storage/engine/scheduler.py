"""Continuous batching over the tier cache: a queue, chunked prefill, batched decode, admission.

Each :meth:`Scheduler.step` is one forward of the model:

1. apply the storage threads' completions (:meth:`TierCache.poll`);
2. admit waiting requests in arrival order while the device pool has room for the whole request
   (its prompt and every token it may generate, so a running request is never preempted) and the
   prefetch policy lets it go; a request still waiting for its prefetch lets later ones pass;
3. build one batch: a decode token for every generating request, then prompt chunks of the
   prefilling ones up to ``chunk_tokens`` (a long prompt takes several steps and never holds up
   decoding);
4. run the forward with the admitted requests' L2→L1 loads overlapped layer by layer, starting
   between layers the reads of requests whose storage query answered meanwhile;
5. record first tokens (TTFT) and outputs, and hand finished requests' KV back to the cache.

The cache supplies every admitted request's prefix, so a request computes only its uncached
suffix; the device pool bounds admission, so a workload larger than the device pool evicts.

A request is checked once, at :meth:`Scheduler.submit`, before it takes anything
(:func:`validate_request`): a request the engine could never serve is refused with an
:class:`~hicache_storage.engine.errors.InvalidRequestError`. An unexpected error while one request
is admitted, computed or released fails that request alone: what it held (locks, pins, device and
host slots, its prefetch) is given back, it ends ``FAILED`` with a
:class:`~hicache_storage.engine.errors.RequestFailedError`, and the others are served. A forward
that raises is retried one request at a time, so only the request that breaks it fails.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import positive_int

from .cache import Lease, Lookup, TierCache
from .collector import CollectorPauses, ManagedCollection
from .errors import InvalidRequestError, PoolMismatchError, RequestFailedError, RequestTypeError
from .loading import LayerLoad
from .model import LlamaModel, Segment, next_token

__all__ = ["Request", "RequestState", "Scheduler", "StepRecord", "validate_request"]

logger = logging.getLogger(__name__)

_ids = itertools.count()

_IDLE_BLOCK_S = 0.005
"""How long the scheduler blocks for a prefetch when nothing runs, before it looks again."""

_READS_EVERY_LAYERS = 4
"""Layers between two looks, inside a forward, for fetches whose reads can start."""


@dataclass(frozen=True)
class StepRecord:
    """Where one scheduler step's time went (see :attr:`Scheduler.on_step`).

    Seconds measured on the scheduler's thread: ``poll_s`` applying finished reads and writes,
    ``admit_s`` deciding and admitting (waits for fetches and host room included), ``forward_s``
    the forward (its exposed load included), ``finish_s`` releasing finished requests (their
    write-through copies and any wait for host room). ``host_wait_s`` is the part of the step
    spent waiting for background writes to free host room. ``write_backlog_tokens`` and
    ``read_s_per_page`` are the host tokens waiting to be written and the measured seconds a
    storage read takes per page (None: not measured) when the step ended. ``gc_s`` is how long
    the garbage collector ran, in any thread, since the previous step ended: every thread waits
    for it (:mod:`~hicache_storage.engine.collector`).
    """

    started: float
    """The step's start on the scheduler's clock."""
    poll_s: float
    admit_s: float
    forward_s: float
    finish_s: float
    exposed_load_s: float
    host_wait_s: float
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    admitted: int
    loaded_tokens: int
    write_backlog_tokens: int = 0
    read_s_per_page: float | None = None
    gc_s: float = 0.0


class RequestState(enum.Enum):
    """Where a request is; only ever moves forward."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    FAILED = "failed"
    """Ended by an error (``Request.error``); everything it held was given back."""


@dataclass(eq=False)
class Request:
    """One generation request and what happened to it.

    Parameters
    ----------
    prompt
        Token ids in ``[0, vocab_size)``: a sequence of ints (numpy integers too) or a 1-D
        integer tensor or array; :meth:`Scheduler.submit` replaces it with a tuple of ints.
    max_new_tokens
        Tokens to generate greedily, an int of at least 1.
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
    storage_found: int = 0
    """Prompt tokens its existence query found in storage (``storage_hit`` came of them)."""
    lookup: Lookup | None = field(default=None, repr=False)
    lease: Lease | None = field(default=None, repr=False)
    computed: int = 0
    error: RequestFailedError | None = None
    submitted_at: float | None = None
    """When :meth:`Scheduler.submit` took it (its storage query starts then)."""
    ready_at: float | None = None
    """When the prefetch policy first let the request go (from then on it waited for room)."""
    query_s: float | None = None
    """Seconds its storage existence query took (None: it asked storage nothing)."""
    load_s: float = 0.0
    """Seconds the forwards that loaded its prefix from the host waited for the copy."""

    @property
    def asked_at(self) -> float:
        """When its storage query started: submission, or its arrival if that came later."""
        return self.arrival if self.submitted_at is None else max(self.submitted_at, self.arrival)

    @property
    def timings(self) -> dict[str, float] | None:
        """Where the time to the first token went, in seconds, once it came.

        ``storage_query`` and ``storage_read`` are the waits for storage before the prefetch
        policy let the request go (the query counts only as long as the request waited);
        ``queue`` the rest of the wait before admission (for the scheduler's turn, room or a
        batch slot); ``load`` the L2→L1 copy time
        the forward waited for; ``compute`` the rest, up to the first token.
        """
        if self.first_token_at is None or self.admitted_at is None:
            return None
        ready = self.admitted_at if self.ready_at is None else self.ready_at
        storage = max(ready - self.asked_at, 0.0) if self.query_s is not None else 0.0
        query = min(self.query_s or 0.0, storage)
        load = min(self.load_s, self.first_token_at - self.admitted_at)
        return {
            "storage_query": query,
            "storage_read": storage - query,
            "queue": max(self.admitted_at - self.arrival - storage, 0.0),
            "load": load,
            "compute": max(self.first_token_at - self.admitted_at - load, 0.0),
        }

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


def _token_ids(prompt: object) -> list[object]:
    """Return the prompt's elements, from accepted containers only (no str, 2-D or floats)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex:
            raise RequestTypeError(
                f"a prompt tensor must be 1-D of an integer dtype, got {tuple(prompt.shape)} "
                f"{prompt.dtype}"
            )
        if prompt.dtype is torch.bool:
            raise RequestTypeError("a prompt tensor must be of an integer dtype, got torch.bool")
        return list(prompt.tolist())
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise RequestTypeError(
                f"a prompt array must be 1-D of an integer dtype, got {prompt.shape} {prompt.dtype}"
            )
        return list(prompt.tolist())
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise RequestTypeError(
            "a prompt is a sequence of token ids (a list or tuple of ints, or a 1-D integer "
            f"tensor or array), got {type(prompt).__name__}"
        )
    return list(prompt)


def validate_request(
    request: Request,
    *,
    vocab_size: int,
    page_size: int | None = None,
    device_slots: int | None = None,
) -> None:
    """Refuse a request the engine can never serve, before it takes anything; normalise it.

    ``prompt`` becomes a tuple of ints and ``max_new_tokens`` an int. With ``device_slots``
    (the device pool's size), a request that needs more slots, in whole ``page_size`` pages,
    than the pool holds is refused rather than left waiting for room that never comes.

    Raises
    ------
    RequestTypeError
        If the prompt is not a sequence of ints (bools, floats, strings, 2-D tensors ...), or
        ``max_new_tokens`` is not an int, or ``seed`` is neither a str nor None.
    InvalidRequestError
        If the prompt is empty or holds an id outside ``[0, vocab_size)``, ``max_new_tokens`` is
        below 1, the request could never fit the device pool, or the request object was
        submitted before (each :class:`Request` is served once).
    """
    if (
        request.state is not RequestState.WAITING
        or request.lookup is not None
        or request.lease is not None
        or request.output
    ):
        raise InvalidRequestError(
            f"request {request.rid} was submitted before (it is {request.state.value}); "
            "a Request is served once: make a new one"
        )
    tokens = _token_ids(request.prompt)
    if not tokens:
        raise InvalidRequestError(f"request {request.rid} has an empty prompt")
    ids: list[int] = []
    for i, token in enumerate(tokens):
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise RequestTypeError(
                f"request {request.rid}: prompt token {i} is {token!r} "
                f"({type(token).__name__}); token ids are ints"
            )
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"request {request.rid}: prompt token {i} is {token}; the model's token ids "
                f"lie in [0, {vocab_size})"
            )
        ids.append(int(token))
    new = request.max_new_tokens
    if isinstance(new, (bool, np.bool_)) or not isinstance(new, (int, np.integer)):
        raise RequestTypeError(
            f"request {request.rid}: max_new_tokens must be an int, got {new!r} "
            f"({type(new).__name__})"
        )
    if new < 1:
        raise InvalidRequestError(
            f"request {request.rid}: max_new_tokens must be at least 1, got {new}"
        )
    if request.seed is not None and not isinstance(request.seed, str):
        raise RequestTypeError(
            f"request {request.rid}: seed must be a str or None, got {type(request.seed).__name__}"
        )
    if device_slots is not None:
        page = page_size or 1
        need = -(-(len(tokens) + int(new) - 1) // page) * page
        if need > device_slots:
            raise InvalidRequestError(
                f"request {request.rid} needs {need} device slots; the pool has {device_slots}, "
                "so it could never be admitted"
            )
    request.prompt = tuple(ids)
    request.max_new_tokens = int(new)


def _check_device_pool(model: LlamaModel, cache: TierCache) -> None:
    """Refuse a device pool that does not hold the model's KV, naming both sides."""
    c = model.config
    pool = cache.device_pool
    mine = (2, c.layers, c.kv_heads, c.head_dim, c.dtype, model.device)
    theirs = (
        pool.num_kv,
        pool.layer_num,
        pool.row_shape[0],
        math.prod(pool.row_shape[1:]),
        pool.dtype,
        pool.device,
    )
    if mine != theirs:
        raise PoolMismatchError(
            f"the device pool's (kv, layers, KV heads, head dim, dtype, device) = {theirs} do "
            f"not hold the model's {mine}"
        )


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
    managed_gc
        Run the garbage collector on this thread between steps, over what serving made
        (:class:`~hicache_storage.engine.collector.ManagedCollection`), from construction until
        :meth:`close`: automatic collection is turned off and what is alive now frozen,
        process-wide, as serving engines do at startup. Otherwise a collection runs in whichever
        thread allocates past the threshold, inside a forward or a storage call, with every
        other thread waiting for it. Off by default for a scheduler embedded in someone else's
        process.

    Raises
    ------
    PoolMismatchError
        If the cache's device pool does not hold the model's KV (layers, KV heads, head dim,
        dtype, device); a :class:`~hicache_storage.errors.ConfigError`.
    ConfigError
        If a bound is not a positive int, or the cache refuses the model
        (:meth:`TierCache.bind_model`: it serves another, or its scheme's object format differs).
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: TierCache,
        *,
        chunk_tokens: int = 512,
        max_running: int = 64,
        clock: Callable[[], float] = time.perf_counter,
        managed_gc: bool = False,
    ) -> None:
        for name, value in (("chunk_tokens", chunk_tokens), ("max_running", max_running)):
            positive_int(name, value, ConfigError)
        if not isinstance(managed_gc, bool):
            raise ConfigError(f"managed_gc must be a bool, got {managed_gc!r}")
        _check_device_pool(model, cache)
        cache.bind_model(model.identity)  # stored pages name the model that computed them
        self.model = model
        self.cache = cache
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.forwards = 0
        self.on_step: Callable[[StepRecord], None] | None = None
        """Called with each step's :class:`StepRecord` (a bench's trace); None: not recorded."""
        self._admitted: list[Request] = []
        self._slots_on_device: dict[int, torch.Tensor] = {}
        """Running requests' device slots on the model's device, by request id."""
        self._managed_gc = managed_gc
        if managed_gc:  # before the pauses are measured: this first collection is no one's
            ManagedCollection.hold()
        self.collector = CollectorPauses()
        """The garbage collector's pauses, measured for each step's record."""

    @property
    def idle(self) -> bool:
        """Whether no request is waiting or running."""
        return not self.waiting and not self.running

    def validate(self, request: Request) -> None:
        """Refuse ``request`` unless this scheduler can serve it (see :func:`validate_request`)."""
        validate_request(
            request,
            vocab_size=self.model.config.vocab_size,
            page_size=self.cache.config.page_size,
            device_slots=self.cache.device_pool.size,
        )

    def submit(self, request: Request, *, arrival: float | None = None) -> Request:
        """Queue ``request`` (stamped as arriving now unless ``arrival`` is given).

        Raises
        ------
        InvalidRequestError
            If the request can never be served (:func:`validate_request`); nothing was taken.
        """
        self.validate(request)
        request.submitted_at = self.clock()
        request.arrival = request.submitted_at if arrival is None else arrival
        request.lookup = self.cache.lookup(request.prompt, seed=request.seed)
        self.waiting.append(request)
        return request

    def step(self) -> list[Request]:
        """Admit, run one forward, and return the requests that finished in it."""
        if self._managed_gc:
            ManagedCollection.collect_due()
        stamp, started = self.clock(), time.perf_counter()
        waited = self.cache.stats.host_room_wait_s
        self.cache.poll()
        polled = time.perf_counter()
        self._admit()
        admitted_s = time.perf_counter() - polled
        if not self.running:
            return []
        batch = self._batch()
        decode = sum(r.state is RequestState.DECODE for r, _, _ in batch)
        load = self.cache.take_load()
        loaded, self._admitted = self._admitted, []
        cache = self.cache
        backups = cache.ride(
            [
                (request.lease, len(request.prompt))
                for request, _, chunk in batch
                if request.state is RequestState.PREFILL
                and request.lease is not None
                and request.computed + chunk >= len(request.prompt)
            ]
        )

        def layer_ready(layer: int) -> None:
            if load is not None:
                load.wait(layer)
            if backups is not None and layer:  # the layer before has queued its KV writes
                backups.written(layer - 1)
            if layer % _READS_EVERY_LAYERS == 0:  # reads of requests that came meanwhile
                cache.start_reads()

        began = time.perf_counter()
        try:
            logits = self.model.forward(
                [segment for _, segment, _ in batch],
                self.cache.device_pool,
                layer_ready=layer_ready,
            )
            if backups is not None:
                backups.finish()
            tokens: list[int | None] = [next_token(row) for row in logits]
            measured = True
        except Exception:  # noqa: BLE001 - find the request that breaks it; the others go on
            logger.warning("a batched forward failed; computing its requests one by one")
            if backups is not None:  # its copies may hold a failed forward's KV
                backups.abandon()
            tokens = self._forward_one_by_one(batch, load)
            measured = False
        forward_s = seconds = time.perf_counter() - began
        exposed = 0.0
        if load is not None:
            timing = load.timing()
            self.cache.record_load(timing)
            exposed = timing.exposed_s
            seconds -= exposed
            for request in loaded:
                request.load_s += exposed
        if measured:  # what computing costs here prices recompute for the prefetch policy
            self.cache.costs.observe_forward(
                sum(n for _, _, n in batch), seconds, requests=len(batch)
            )
        self.forwards += 1
        now = self.clock()
        finished: list[Request] = []
        for (request, _, chunk), token in zip(batch, tokens, strict=True):
            if token is None:
                continue
            if request.state is RequestState.PREFILL:
                request.computed += chunk
                if request.computed < len(request.prompt):
                    continue
                request.first_token_at = now
                request.state = RequestState.DECODE
                lease = request.lease
                assert lease is not None
                try:  # its pages are backed up under its decode steps, not after them
                    self.cache.prefilled(lease, len(request.prompt))
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    self.fail(request, exc)
                    continue
            request.output.append(token)
            if len(request.output) >= request.max_new_tokens:
                finished.append(request)
        released = time.perf_counter()
        for request in finished:
            self._finish(request, now)
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    started=stamp,
                    poll_s=polled - started,
                    admit_s=admitted_s,
                    forward_s=forward_s,
                    finish_s=time.perf_counter() - released,
                    exposed_load_s=exposed,
                    host_wait_s=self.cache.stats.host_room_wait_s - waited,
                    prefill_tokens=sum(n for _, _, n in batch) - decode,
                    decode_tokens=decode,
                    context_tokens=sum(int(segment.slots.numel()) for _, segment, _ in batch),
                    admitted=len(loaded),
                    loaded_tokens=0 if load is None else load.tokens,
                    write_backlog_tokens=self.cache.write_backlog_tokens,
                    read_s_per_page=self.cache.costs.read_s_per_page,
                    gc_s=self.collector.take(),
                )
            )
        return [r for r in finished if r.state is RequestState.FINISHED]

    def _forward_one_by_one(
        self, batch: list[tuple[Request, Segment, int]], load: LayerLoad | None
    ) -> list[int | None]:
        """Compute each request of a failed forward alone; fail those that fail alone."""
        if load is not None:  # slots the tree already counts as loaded must hold their KV
            load.finish()
        tokens: list[int | None] = []
        for request, segment, _ in batch:
            try:
                logits = self.model.forward([segment], self.cache.device_pool)[0]
                tokens.append(next_token(logits))
            except Exception as exc:  # noqa: BLE001 - the request's failure, not the engine's
                self.fail(request, exc)
                tokens.append(None)
        return tokens

    def fail(self, request: Request, exc: BaseException) -> None:
        """End ``request`` as ``FAILED`` with ``exc`` as the cause, giving back what it holds.

        Its prefetch is stopped (host slots and pin returned), its lease released (lock and
        device slots; nothing it computed enters the tree but a prompt whose prefill ended) and
        it leaves the queue.
        """
        if request.state in (RequestState.FINISHED, RequestState.FAILED):
            return
        error = RequestFailedError(
            f"request {request.rid} failed while {request.state.value}: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        logger.warning("%s", error, exc_info=exc)
        try:
            if request.lookup is not None:
                self.cache.cancel(request.lookup)
            lease = request.lease
            if lease is not None and not lease.released:
                self.cache.release(lease, request.prompt[: lease.cached], lease.slots)
        except Exception:  # logged; the request ends failed either way
            logger.exception("giving back what request %d held failed", request.rid)
        finally:
            request.error = error
            request.state = RequestState.FAILED
            request.finished_at = self.clock()
            if request in self.waiting:
                self.waiting.remove(request)
            if request in self.running:
                self.running.remove(request)
            self._slots_on_device.pop(request.rid, None)

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
        self._slots_on_device.clear()
        self.collector.close()
        if self._managed_gc:
            self._managed_gc = False
            ManagedCollection.release()

    # -- internals --------------------------------------------------------------------------------

    def _admit(self) -> None:
        admitted: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        forward_s = self._next_forward_s()
        busy = bool(self.running)
        # A fetch that lands after the step has started waits for the whole next forward, where
        # blocking for it delays the running requests instead: the first token of each one still
        # prefilling (a decode's next token is not a first). Blocking pays while the wait, paid
        # by this request and each of those, is shorter than the forward it would miss; with
        # nothing running it delays no one. One budget for all the step's waiting requests.
        prefilling = sum(r.state is RequestState.PREFILL for r in self.running)
        budget = forward_s / (1 + prefilling) if busy else _IDLE_BLOCK_S
        deadline = time.perf_counter() + budget
        for request in self.waiting:
            if len(self.running) + len(admitted) >= self.max_running:
                break
            lookup = request.lookup
            assert lookup is not None
            try:
                self.cache.recheck(lookup)
                ready = self.cache.ready(
                    lookup,
                    block_s=max(deadline - time.perf_counter(), 0.0),
                    next_step_s=forward_s if busy else _IDLE_BLOCK_S,
                )
                if not ready:
                    continue
                if request.ready_at is None:
                    request.ready_at = self._ready_since(request)
                if lookup.fetch is not None:
                    request.query_s = lookup.fetch.query_s
                lease = self.cache.acquire(lookup, request.total_tokens)
            except Exception as exc:  # noqa: BLE001 - this request fails, the queue goes on
                failed.append((request, exc))
                continue
            if lease is None:
                if not self.running and not admitted:  # nothing running will ever free room
                    locked = self.cache.tree.locked_tokens
                    failed.append(
                        (
                            request,
                            RuntimeError(
                                f"no room for {request.total_tokens} tokens with no request "
                                f"running ({locked} tokens locked): the device pool would "
                                "never admit it"
                            ),
                        )
                    )
                break
            request.lease = lease
            request.computed = lease.cached
            request.device_hit = lease.device_hit
            request.host_hit = lease.host_hit
            request.storage_hit = lease.storage_hit
            begin, end = lease.in_storage
            request.storage_found = end - begin
            request.state = RequestState.PREFILL
            request.admitted_at = self.clock()
            admitted.append(request)
        for request in admitted:
            self.waiting.remove(request)
        self.running.extend(admitted)
        self._admitted.extend(admitted)
        for request, error in failed:
            self.fail(request, error)

    def _ready_since(self, request: Request) -> float:
        """When the prefetch policy would first have let ``request`` go (the scheduler's clock).

        A fetch that finished while the scheduler was busy (in a forward) let its request go
        then: the rest of the wait was for the scheduler's turn, not for storage.
        """
        now = self.clock()
        fetch = None if request.lookup is None else request.lookup.fetch
        if fetch is None or fetch.finished_at is None:
            return now
        since = max(time.monotonic() - fetch.finished_at, 0.0)
        return max(now - since, min(request.asked_at, now))

    def _next_forward_s(self) -> float:
        """Seconds the next forward of the running requests should take, on the measured fit.

        A request that does not join it waits this long for the next chance.
        """
        pending = sum(
            1 if r.state is RequestState.DECODE else len(r.prompt) - r.computed
            for r in self.running
        )
        costs = self.cache.costs
        predicted = costs.forward_time_s(min(pending, self.chunk_tokens)) if pending else 0.0
        return predicted if predicted is not None else costs.forward_s or 0.0

    def _batch(self) -> list[tuple[Request, Segment, int]]:
        """Return the forward's work: a decode token per generating request, then prompt chunks.

        Prefilling requests share what ``chunk_tokens`` leaves after the decode tokens, in
        admission order (at least one token a step, so a prefill always progresses). The new
        tokens go to the device in one copy and each request's slots once, when it first
        runs: a copy that waits for the GPU would hold the launch of the forward until the
        transfers queued before it (backups, loads) are done.
        """
        device = self.model.device
        budget = self.chunk_tokens - sum(r.state is RequestState.DECODE for r in self.running)
        budget = max(budget, 1)
        work: list[tuple[Request, torch.Tensor, Sequence[int]]] = []
        for request in self.running:
            slots = self._slots_on_device.get(request.rid)
            if slots is None:
                lease = request.lease
                assert lease is not None
                slots = lease.slots.to(self.cache.device_pool.device, non_blocking=True)
                self._slots_on_device[request.rid] = slots
            if request.state is RequestState.DECODE:
                ctx = len(request.prompt) + len(request.output)
                work.append((request, slots[:ctx], request.output[-1:]))
                continue
            n = min(len(request.prompt) - request.computed, budget)
            if n <= 0:
                continue
            budget -= n
            end = request.computed + n
            work.append((request, slots[:end], request.prompt[request.computed : end]))
        if not work:
            return []
        flat = [token for _, _, tokens in work for token in tokens]
        new = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
        sizes = [len(tokens) for _, _, tokens in work]
        return [
            (request, Segment(part, slots), len(part))
            for (request, slots, _), part in zip(work, new.split_with_sizes(sizes), strict=True)
        ]

    def _finish(self, request: Request, now: float) -> None:
        lease = request.lease
        assert lease is not None
        held = [*request.prompt, *request.output][: request.total_tokens]
        try:
            self.cache.release(lease, held, lease.slots)
        except Exception as exc:  # noqa: BLE001 - released what it could; the request fails
            self.fail(request, exc)
            return
        request.state = RequestState.FINISHED
        request.finished_at = now
        self.running.remove(request)
        self._slots_on_device.pop(request.rid, None)
