"""What recomputing a chunk costs vLLM: the prefill the planner prices a fetch against.

The planner (:class:`~hicache_storage.planner.Planner`) fetches a request's stored chunks only
where reading them beats computing them, and it prices computing from forwards
(:meth:`~hicache_storage.planner.Planner.forward`). A vLLM secondary tier sees no forward: its
hooks say which requests a step scheduled for the first time (``on_schedule_end``), which chunks
a request looked up (``lookup``) and which chunks vLLM hands it once computed (``submit_store``,
each key with its end position in the request), but neither a step's tokens nor its time.
:class:`PrefillClock` derives forwards from those, or, where the tier entry gives
``prefill_tokens_per_s``, prices them at that rate instead (and before the first request).

A derived forward is one step's: the first store jobs of the requests it scheduled for the
first time, counting only jobs whose every chunk the request looked up (chunks of its prompt
that no tier served, so it computed them, not ones its decode filled later), a chunk's tokens
each. Its seconds run from the step's end to the jobs' arrival, which includes the forward and
vLLM's copy of the chunks to its CPU tier, reported a step later or more. The tokens are at most
those the step computed (it also computed partial chunks, chunks another request stored first,
other requests' decode) and the seconds at least its forward, so its seconds per token are at
least the step's. The least of the last :data:`~hicache_storage.planner.rates.READ_SAMPLES`
(the planner's window for its read rate) is then the tightest such bound, which a step slowed
by a busy CPU does not raise. It is fed at one size, vLLM's step budget: the planner's fit of a
single size prices a token at the mean of what it was fed, fixed costs included, which is never
below what one more token costs (a line fitted through a few noisy steps of similar size could
fall below it). Computing is priced high, never low: the planner errs toward fetching, vLLM's
behaviour without it, rather than toward recomputing what reads would serve faster. Until the
first such step (a tier whose requests all hit sees none) computing is unpriced and the planner
fetches; the entry's ``prefill_tokens_per_s`` prices it from the start. The requests sharing a
forward are those the scheduler holds (each waits for a forward that recomputes another's
chunks).

Every method runs on vLLM's scheduler thread, which calls the tier's hooks one at a time.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from hicache_storage.planner import Planner
from hicache_storage.planner.rates import READ_SAMPLES

__all__ = ["PrefillClock"]


@dataclass
class _Step:
    """The first store jobs of the requests one step scheduled for the first time."""

    at: float
    tokens: int = 0
    arrived: float = 0.0


@dataclass
class _Request:
    """A request the scheduler holds: the chunks it looked up, and the step that began it."""

    asked: set[OffloadKey] = field(default_factory=set)
    step: _Step | None = None
    stored: bool = False


class PrefillClock:
    """Feeds the planner forwards derived from the tier's hooks, or at a configured rate.

    Parameters
    ----------
    planner
        The planner whose recompute cost this prices.
    chunk_tokens
        Tokens of a chunk (of the KV group with the smallest chunks): what a stored key counts.
    step_tokens
        Tokens one scheduler step computes at most (vLLM's ``max_num_batched_tokens``), the one
        size every forward is fed at.
    rate
        Tokens a second of prefill (the tier's ``prefill_tokens_per_s``), or None to time the
        derived forwards.
    clock
        Monotonic seconds.
    """

    def __init__(
        self,
        planner: Planner,
        chunk_tokens: int,
        step_tokens: int,
        *,
        rate: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._planner = planner
        self._chunk_tokens = chunk_tokens
        self._step_tokens = step_tokens
        self._rate = rate
        self._per_token: collections.deque[float] = collections.deque(maxlen=READ_SAMPLES)
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._steps: list[_Step] = []
        if rate is not None:
            planner.forward(step_tokens, step_tokens / rate)

    def started(self, req_id: str) -> None:
        """Count a request that joined the scheduler."""
        self._requests.setdefault(req_id, _Request())

    def looked_up(self, key: OffloadKey, req_id: str) -> None:
        """Note that the request asked the tier for ``key`` (a chunk of its prompt)."""
        request = self._requests.get(req_id)
        if request is not None and not request.stored:
            request.asked.add(key)

    def scheduled(self, new_req_ids: Iterable[str]) -> None:
        """Start the clock of a step that scheduled ``new_req_ids`` for the first time."""
        step: _Step | None = None
        for req_id in new_req_ids:
            request = self._requests.get(req_id)
            if request is None or request.step is not None or request.stored:
                continue
            if step is None:
                step = _Step(self._clock())
                self._steps.append(step)
            request.step = step

    def stored(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Take a store job's ``keys`` (computed, copied to vLLM's CPU tier) as a prefill sample."""
        request = self._requests.get(req_context.req_id)
        if request is None or request.stored:
            return
        request.stored = True
        step, asked = request.step, request.asked
        request.asked = set()
        if step is None or not keys or not all(key in asked for key in keys):
            return
        ends = {req_context.get_offload_key_position(key) for key in keys}
        step.tokens += len(ends) * self._chunk_tokens
        step.arrived = self._clock()

    def finished(self, req_id: str) -> None:
        """Forget a request that left the scheduler."""
        self._requests.pop(req_id, None)

    def flush(self) -> None:
        """Feed the planner the forwards whose chunks have arrived since the last call."""
        if not self._steps:
            return
        keep = []
        sharing = max(len(self._requests), 1)
        waiting = {id(request.step) for request in self._requests.values() if not request.stored}
        for step in self._steps:
            if step.tokens > 0:
                if self._rate is not None:
                    per_token = 1.0 / self._rate
                else:
                    self._per_token.append((step.arrived - step.at) / step.tokens)
                    per_token = min(self._per_token)
                tokens = self._step_tokens
                self._planner.forward(tokens, tokens * per_token, requests=sharing)
                step.tokens = 0
            if id(step) in waiting:
                keep.append(step)  # a request it began has not stored its first chunks yet
        self._steps = keep
