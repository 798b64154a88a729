from __future__ import annotations

import itertools

import pytest

from hicache_storage.engine.workloads import Conversation, DocumentQueries, MultiTurn
from hicache_storage.errors import ConfigError


def test_multiturn_histories_share_the_system_prompt_and_grow() -> None:
    workload = MultiTurn(clients=3, rounds=4, system_tokens=16, turn_tokens=(2, 5), vocab_size=50)
    turns = list(workload.turns())
    assert [(t.round, t.client) for t in turns] == [(r, c) for r in range(4) for c in range(3)]
    firsts = [t for t in turns if t.round == 0]
    assert len({t.new_tokens[:16] for t in firsts}) == 1
    chats = {c: Conversation() for c in range(3)}
    lengths: dict[int, list[int]] = {c: [] for c in range(3)}
    for turn in turns:
        prompt = chats[turn.client].prompt(turn)
        lengths[turn.client].append(len(prompt))
        assert prompt[: len(chats[turn.client].history)] == chats[turn.client].history
        chats[turn.client].answer(turn, [1] * turn.max_new_tokens)
    assert all(a < b for ls in lengths.values() for a, b in itertools.pairwise(ls))


def test_workloads_are_seeded() -> None:
    a = list(MultiTurn(clients=2, rounds=2, seed=1).turns())
    assert a == list(MultiTurn(clients=2, rounds=2, seed=1).turns())
    assert a != list(MultiTurn(clients=2, rounds=2, seed=2).turns())


def test_arrivals_follow_the_rate() -> None:
    turns = list(MultiTurn(clients=50, rounds=4, rate_per_s=10.0, system_tokens=1).turns())
    arrivals = [t.arrival_s for t in turns]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 10 < arrivals[-1] < 40  # 200 arrivals at 10/s: about 20 s


def test_documents_are_the_shared_prefixes() -> None:
    turns = list(
        DocumentQueries(documents=2, queries=3, document_tokens=64, question_tokens=4).turns()
    )
    assert len(turns) == 6
    assert len({t.new_tokens[:64] for t in turns}) == 2
    assert len({t.new_tokens for t in turns}) == 6


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clients": 0},
        {"rounds": -1},
        {"turn_tokens": (5, 2)},
        {"rate_per_s": 0.0},
        {"clients": True},
    ],
)
def test_bad_workloads_are_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"clients": 1, "rounds": 1, **kwargs}
    with pytest.raises(ConfigError):
        MultiTurn(**args)  # type: ignore[arg-type]
