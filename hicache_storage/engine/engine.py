"""The engine: a model, a tier cache and a scheduler, behind ``generate`` and ``serve``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import TracebackType

from typing_extensions import Self

from .cache import TierCache
from .errors import InvalidRequestError
from .model import LlamaModel
from .scheduler import Request, RequestState, Scheduler, validate_request

__all__ = ["Engine"]


class Engine:
    """Greedy generation with a :class:`LlamaModel` over a :class:`TierCache`.

    The engine owns the cache: :meth:`close` (or leaving a ``with`` block) stops its threads.
    Its scheduler names the model to the cache (:meth:`TierCache.bind_model`), so stored pages
    carry the model's identity and the host pool's format in their keys.

    Parameters
    ----------
    model
        The model; its KV shape must match the cache's device pool.
    cache
        The tier cache, or None to recompute every token of every step (the oracle, no pool).
    chunk_tokens, max_running, managed_gc
        The scheduler's prefill chunk and batch bounds, and whether it runs the garbage
        collector itself between steps (see :class:`Scheduler`).

    Raises
    ------
    PoolMismatchError
        If the cache's device pool does not hold the model's KV (see :class:`Scheduler`).
    ConfigError
        If the cache serves another model, or its key scheme's object format is not this
        model's (see :meth:`TierCache.bind_model`).
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: TierCache | None,
        *,
        chunk_tokens: int = 512,
        max_running: int = 64,
        managed_gc: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.scheduler = (
            None
            if cache is None
            else Scheduler(
                model,
                cache,
                chunk_tokens=chunk_tokens,
                max_running=max_running,
                managed_gc=managed_gc,
            )
        )

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, seed: str | None = None
    ) -> list[int]:
        """Continue ``prompt`` greedily for ``max_new_tokens`` tokens, reusing cached prefixes.

        ``seed`` is the request's cache namespace (``namespace_seed(extra_key, cache_salt)``).

        Raises
        ------
        InvalidRequestError
            If the request can never be served (see :func:`validate_request`).
        RequestFailedError
            If it failed while served (the engine serves on).
        """
        request = self.serve([Request(prompt, max_new_tokens, seed)])[0]
        if request.error is not None:
            raise request.error
        return request.output

    def serve(self, requests: Iterable[Request]) -> list[Request]:
        """Run ``requests`` together (batched, as room allows) to completion; return them.

        Every request is checked first: if one is invalid (or the same object is given twice)
        none is submitted and :class:`InvalidRequestError` says which. A request that fails
        while served ends ``FAILED`` with its ``Request.error``; the others finish. An
        error that is no single request's (a failed poll or load) fails the batch's unfinished
        requests, giving back what they hold, and is raised.
        """
        batch = list(requests)
        seen: set[int] = set()
        for index, request in enumerate(batch):
            if id(request) in seen:
                raise InvalidRequestError(
                    f"request {index} of the batch (rid {request.rid}) is given twice; a "
                    "Request is served once"
                )
            seen.add(id(request))
            self._validate(request)
        if self.scheduler is None:
            for request in batch:
                request.output = self.model.generate_no_cache(
                    request.prompt, request.max_new_tokens
                )
                request.state = RequestState.FINISHED
            return batch
        try:  # a submit polls the cache, so a storage bug may surface there too
            for request in batch:
                self.scheduler.submit(request)
            self.scheduler.run()
        except BaseException as exc:
            for request in batch:
                self.scheduler.fail(request, exc)
            raise
        return batch

    def _validate(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.validate(request)
        else:
            validate_request(request, vocab_size=self.model.config.vocab_size)

    def close(self) -> None:
        """Stop the scheduler and the cache's threads (pending backups are written first).

        Bounded by the cache's ``close_timeout_s``: a storage call still running then is given
        up on, and its thread acts on nothing when the call returns (:meth:`TierCache.close`).
        """
        if self.scheduler is not None:
            self.scheduler.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
