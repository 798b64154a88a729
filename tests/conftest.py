"""Shared fixtures: backends built the way users build them, and host pools of every kind."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache_storage import StorageBackend, create_backend

BACKENDS = ["memory", "file"]

# tests/vllm runs in the vLLM venv (scripts/setup-vllm.sh, scripts/test.sh), which vLLM needs for
# itself: its pins conflict with the SGLang test extra this venv holds.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]


def backend_options(name: str, root: Path) -> dict[str, object]:
    return {"root": str(root)} if name == "file" else {}


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_backend(backend_name: str, tmp_path: Path) -> Iterator[Callable[..., StorageBackend]]:
    built: list[StorageBackend] = []

    def make(**kwargs: object) -> StorageBackend:
        backend = create_backend(backend_name, backend_options(backend_name, tmp_path), **kwargs)
        built.append(backend)
        return backend

    yield make
    for backend in built:
        backend.close()


@pytest.fixture
def backend(make_backend: Callable[..., StorageBackend]) -> StorageBackend:
    return make_backend()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the files whose tests declare the longest time limits first.

    ``scripts/test.sh`` runs files on two workers (pytest-xdist, ``--dist loadfile``), handing out
    files in this order: a long file started last would leave one worker running it alone. A
    test's ``timeout`` mark is its author's statement that it runs long; files keep their
    collection order otherwise.
    """
    limit: dict[str, float] = {}
    for item in items:
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark is not None and mark.args else 0.0
        limit[item.location[0]] = max(limit.get(item.location[0], 0.0), seconds)
    items.sort(key=lambda item: -limit[item.location[0]])
