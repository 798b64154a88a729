"""Request streams that exercise a KV cache the way serving traffic does.

Two shapes matter for a hierarchical cache:

- **Multi-turn conversations**: clients share a system prompt; each round's prompt is the
  client's whole history (earlier turns and answers) plus a new turn. Reuse grows with every
  round, and with many clients the histories outgrow the device pool, so later rounds hit in the
  host pool or storage.
- **Long shared documents**: a few long documents, each queried many times with a short
  question. The document's pages are the reused prefix.

A workload is a seeded, deterministic sequence of :class:`Turn` records; the answers are not known
in advance, so a multi-turn client's next prompt is built by :class:`Conversation` from the
answers the engine gave.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from hicache_storage.errors import ConfigError
from hicache_storage.kit.options import positive_int

__all__ = ["Conversation", "DocumentQueries", "MultiTurn", "Turn"]


def _positive(name: str, value: int) -> None:
    positive_int(name, value, ConfigError)


@dataclass(frozen=True)
class Turn:
    """One request: who sends it, in which round, when, and its new tokens.

    Attributes
    ----------
    client
        The conversation (or querying client) it belongs to.
    round
        0 for the first request of the client.
    arrival_s
        Seconds after the start of the run at which the request arrives.
    new_tokens
        The tokens this request adds to the client's history.
    max_new_tokens
        Tokens to generate.
    """

    client: int
    round: int
    arrival_s: float
    new_tokens: tuple[int, ...]
    max_new_tokens: int


@dataclass
class Conversation:
    """A client's history: every turn's tokens and every answer, in order."""

    history: list[int] = field(default_factory=list)

    def prompt(self, turn: Turn) -> list[int]:
        """Return the prompt of ``turn``: the history so far plus its new tokens."""
        return [*self.history, *turn.new_tokens]

    def answer(self, turn: Turn, output: list[int]) -> None:
        """Record ``turn`` and the engine's ``output`` so the next prompt includes both."""
        self.history.extend(turn.new_tokens)
        self.history.extend(output)


@dataclass(frozen=True)
class MultiTurn:
    """Multi-turn conversations: ``clients`` by ``rounds`` turns over a shared system prompt.

    Turns arrive round by round, client after client; with ``rate_per_s`` they arrive as a
    Poisson process of that rate, else all at time 0 (a closed loop).
    """

    clients: int
    rounds: int
    system_tokens: int = 256
    turn_tokens: tuple[int, int] = (32, 128)
    max_new_tokens: int = 32
    vocab_size: int = 32000
    rate_per_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "system_tokens", "max_new_tokens", "vocab_size"):
            _positive(name, getattr(self, name))
        low, high = self.turn_tokens
        if not 1 <= low <= high:
            raise ConfigError(
                f"turn_tokens must be (low, high) with 1 <= low <= high, got {low, high}"
            )
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ConfigError(f"rate_per_s must be positive, got {self.rate_per_s}")

    def turns(self) -> Iterator[Turn]:
        """Yield every turn in arrival order; a client's first turn opens with the system prompt."""
        rng = random.Random(self.seed)
        system = tuple(rng.randrange(self.vocab_size) for _ in range(self.system_tokens))
        clock = 0.0
        for round_ in range(self.rounds):
            for client in range(self.clients):
                if self.rate_per_s is not None:
                    clock += rng.expovariate(self.rate_per_s)
                length = rng.randint(*self.turn_tokens)
                tokens = tuple(rng.randrange(self.vocab_size) for _ in range(length))
                yield Turn(
                    client,
                    round_,
                    clock,
                    system + tokens if round_ == 0 else tokens,
                    self.max_new_tokens,
                )


@dataclass(frozen=True)
class DocumentQueries:
    """Long shared documents, each queried ``queries`` times with a short question.

    Every turn is its own request (round 0 of a new client): the document is the shared prefix.
    """

    documents: int
    queries: int
    document_tokens: int = 4096
    question_tokens: int = 32
    max_new_tokens: int = 32
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "documents",
            "queries",
            "document_tokens",
            "question_tokens",
            "max_new_tokens",
            "vocab_size",
        ):
            _positive(name, getattr(self, name))

    def turns(self) -> Iterator[Turn]:
        """Yield the queries interleaved across documents, each with its document's tokens first."""
        rng = random.Random(self.seed)
        docs = [
            tuple(rng.randrange(self.vocab_size) for _ in range(self.document_tokens))
            for _ in range(self.documents)
        ]
        client = 0
        for _ in range(self.queries):
            for doc in docs:
                question = tuple(
                    rng.randrange(self.vocab_size) for _ in range(self.question_tokens)
                )
                yield Turn(client, 0, 0.0, doc + question, self.max_new_tokens)
                client += 1
