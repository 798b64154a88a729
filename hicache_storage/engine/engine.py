"""The engine: a model, a tier cache and a scheduler, behind ``generate`` and ``serve``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import TracebackType

from typing_extensions import Self

from .cache import TierCache
from .model import LlamaModel
from .scheduler import Request, Scheduler

__all__ = ["Engine"]


class Engine:
    """Greedy generation with a :class:`LlamaModel` over a :class:`TierCache`.

    The engine owns the cache: :meth:`close` (or leaving a ``with`` block) stops its threads.

    Parameters
    ----------
    model
        The model; its KV shape must match the cache's device pool.
    cache
        The tier cache, or None to recompute every token of every step (the oracle, no pool).
    chunk_tokens, max_running
        The scheduler's prefill chunk and batch bounds (see :class:`Scheduler`).
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: TierCache | None,
        *,
        chunk_tokens: int = 512,
        max_running: int = 64,
    ) -> None:
        self.model = model
        self.cache = cache
        self.scheduler = (
            None
            if cache is None
            else Scheduler(model, cache, chunk_tokens=chunk_tokens, max_running=max_running)
        )

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, seed: str | None = None
    ) -> list[int]:
        """Continue ``prompt`` greedily for ``max_new_tokens`` tokens, reusing cached prefixes.

        ``seed`` is the request's cache namespace (``namespace_seed(extra_key, cache_salt)``).
        """
        if self.scheduler is None:
            return self.model.generate_no_cache(prompt, max_new_tokens)
        return self.serve([Request(prompt, max_new_tokens, seed)])[0].output

    def serve(self, requests: Iterable[Request]) -> list[Request]:
        """Run ``requests`` together (batched, as room allows) to completion; return them."""
        batch = list(requests)
        if self.scheduler is None:
            for request in batch:
                request.output = self.model.generate_no_cache(
                    request.prompt, request.max_new_tokens
                )
            return batch
        for request in batch:
            self.scheduler.submit(request)
        self.scheduler.run()
        return batch

    def close(self) -> None:
        """Stop the scheduler and the cache's threads (pending backups are written first)."""
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
