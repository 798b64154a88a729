"""The cache's policies and their configuration: when a prefetch stops waiting, what is refused."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hicache_storage.engine.cache import CacheConfig
from hicache_storage.engine.cache_config import (
    PrefetchConfig,
    ThreadConfig,
    WriteConfig,
)
from hicache_storage.engine.policies import (
    PrefetchPolicy,
    PrefetchTimeout,
    WritePolicy,
    prefetch_done_waiting,
)
from hicache_storage.errors import ConfigError

TIMEOUT = PrefetchTimeout(base_s=1.0, per_page_s=0.25)  # 10 pages: a deadline of 3.5 s

BEST, WAIT, TIMED = PrefetchPolicy.BEST_EFFORT, PrefetchPolicy.WAIT_COMPLETE, PrefetchPolicy.TIMEOUT


@pytest.mark.parametrize(
    ("policy", "finished", "pages", "elapsed_s", "done"),
    [
        # best_effort never delays a request, finished or not.
        (BEST, False, 10, 0.0, True),
        (BEST, True, 10, 0.0, True),
        (BEST, False, 0, 1e9, True),
        # wait_complete waits for the fetch to finish, however long it takes.
        (WAIT, False, 10, 0.0, False),
        (WAIT, False, 10, 1e9, False),
        (WAIT, False, 0, 1e9, False),
        (WAIT, True, 10, 0.0, True),
        # timeout: a finished fetch is done at once; else it waits base + per_page * pages.
        (TIMED, True, 10, 0.0, True),
        (TIMED, False, 10, 0.0, False),
        (TIMED, False, 10, 3.49, False),
        (TIMED, False, 10, 3.5, True),
        (TIMED, False, 10, 3.51, True),
        (TIMED, False, 0, 0.99, False),
        (TIMED, False, 0, 1.0, True),
        (TIMED, False, 100, 3.5, False),  # more pages, a later deadline
        (TIMED, False, 100, 26.0, True),
    ],
)
def test_prefetch_done_waiting_follows_each_policy(
    policy: PrefetchPolicy, finished: bool, pages: int, elapsed_s: float, done: bool
) -> None:
    got = prefetch_done_waiting(
        policy, TIMEOUT, finished=finished, pages=pages, elapsed_s=elapsed_s
    )
    assert got is done


def test_prefetch_timeout_deadline_grows_with_the_pages() -> None:
    assert TIMEOUT.deadline_s(0) == 1.0
    assert TIMEOUT.deadline_s(10) == 3.5
    default = PrefetchTimeout()
    assert default.deadline_s(0) == default.base_s > 0
    assert default.deadline_s(100) > default.deadline_s(1)


@pytest.mark.parametrize("field", ["base_s", "per_page_s"])
@pytest.mark.parametrize("value", [-0.001, -1, math.inf, math.nan, True, False, "1", None])
def test_prefetch_timeout_refuses_a_value_that_is_not_a_finite_number(
    field: str, value: Any
) -> None:
    with pytest.raises(ConfigError, match=field):
        PrefetchTimeout(**{field: value})


def test_prefetch_timeout_takes_zero_and_ints() -> None:
    assert PrefetchTimeout(0, 0).deadline_s(1000) == 0
    assert PrefetchTimeout(2, 1).deadline_s(3) == 5


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="base_s"):
        PrefetchTimeout(base_s=-1)


# ---- CacheConfig ---------------------------------------------------------------------------------


def test_cache_config_takes_policy_names_and_gives_the_enums() -> None:
    config = CacheConfig(
        4,
        write=WriteConfig(policy="write_back"),  # type: ignore[arg-type]
        prefetch=PrefetchConfig(policy="best_effort"),  # type: ignore[arg-type]
    )
    assert config.write.policy is WritePolicy.WRITE_BACK
    assert config.prefetch.policy is PrefetchPolicy.BEST_EFFORT
    default = CacheConfig(4)
    assert default.write.policy is WritePolicy.WRITE_THROUGH
    assert default.prefetch.policy is PrefetchPolicy.ADAPTIVE
    assert default.prefetch.capacity is None


@pytest.mark.parametrize(
    ("group", "policy"),
    [
        (WriteConfig, "write_sometimes"),
        (WriteConfig, "WRITE_THROUGH"),
        (PrefetchConfig, "eventually"),
        (PrefetchConfig, ""),
    ],
)
def test_cache_config_refuses_an_unknown_policy_name(group: type, policy: str) -> None:
    with pytest.raises(ConfigError):
        group(policy=policy)


@pytest.mark.parametrize(
    ("group", "name"),
    [
        (None, "page_size"),
        (WriteConfig, "backup_after_hits"),
        (PrefetchConfig, "threshold"),
        (PrefetchConfig, "read_batch_pages"),
        (WriteConfig, "batch_bytes"),
        (WriteConfig, "queue"),
        (ThreadConfig, "queries"),
        (ThreadConfig, "reads"),
    ],
)
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_cache_config_refuses_a_size_that_is_not_a_positive_int(
    group: type | None, name: str, value: Any
) -> None:
    with pytest.raises(ConfigError, match=name):
        if group is None:
            CacheConfig(**{"page_size": value})
        else:
            group(**{name: value})


@pytest.mark.parametrize("value", [0, -4, False, 8.0])
def test_cache_config_refuses_a_prefetch_capacity_that_is_not_a_positive_int(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"prefetch\.capacity"):
        PrefetchConfig(capacity=value)


def test_cache_config_refuses_a_prefetch_timeout_of_another_type() -> None:
    with pytest.raises(ConfigError, match=r"prefetch\.timeout"):
        PrefetchConfig(timeout=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("write", PrefetchConfig()),
        ("prefetch", {"policy": "adaptive"}),
        ("threads", None),
        ("transfer", 16),
    ],
)
def test_cache_config_refuses_a_group_of_another_type(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be a "):
        CacheConfig(4, **{name: value})  # type: ignore[arg-type]
