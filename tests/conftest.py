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
