"""Two engine processes share one L3: what the first stored serves the second, token for token.

Process 1 serves multi-turn conversations through an engine over a storage backend and closes
(flushing its backups); process 2, a fresh process with fresh pools and an empty radix tree,
serves the same prompts over the same storage and must hit it and still give the tokens of
recompute. Each backend runs against a real server started the way its own tests start one
(``tests/backends/*/conftest.py``); a server that cannot be started or reached fails the test.

The engines run in processes forked from a forkserver that imported torch and the engine once,
so that each costs a fraction of a second rather than an interpreter start; each is still a
process of its own, with its own pools, backend connections and threads. The backend's options
reach it as JSON.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage.backends.s3 import provision as s3_provision
from hicache_storage.engine.model import LlamaModel
from hicache_storage.engine.policies import PrefetchPolicy, WritePolicy
from hicache_storage.kit.services import LocalService

from ._child import CONFIG, conversations, serve_job
from .conftest import THREEFS_GEOMETRY, THREEFS_TIMEOUT_S

PROMPTS = conversations(rounds=3, clients=2, seed=21)
NEW_TOKENS = 4
CHILD_TIMEOUT_S = 60.0


Target = tuple[str, dict[str, Any], dict[str, str]]
"""A backend name, its options and the environment its clients need."""


@pytest.fixture(scope="module")
def forkserver() -> multiprocessing.context.BaseContext:
    """Return the forkserver context, preloading torch and the engine (if not yet started)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "hicache_storage.engine.engine", "tests.engine._child"]
    )
    return context


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """The tokens of recompute for every prompt (the no-cache oracle)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaModel(CONFIG)
        return [model.generate_no_cache(prompt, NEW_TOKENS) for prompt in PROMPTS]
    finally:
        torch.set_num_threads(threads)


def _prefix() -> str:
    return f"engine-{secrets.token_hex(4)}"


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """Return the name, options and client environment of the backend under test."""
    name = str(request.param)
    if name == "file":
        return name, {"root": str(tmp_path / "l3")}, {}
    if name == "redis":
        cluster: LocalService = request.getfixturevalue("redis_cluster")
        return name, {**cluster.options, "prefix": _prefix()}, {}
    if name == "mooncake":
        master: LocalService = request.getfixturevalue("mooncake_store")
        options = {
            "master": master.options["master"],
            "global_segment_size": 0,
            "local_hostname": "127.0.0.1",
            "prefix": _prefix() + "/",
        }
        return name, options, {}
    if name == "s3":
        s3: LocalService = request.getfixturevalue("s3_service")
        env = s3_provision.credentials_env(s3)
        return name, {**s3.options, "prefix": _prefix() + "/"}, env
    assert name == "3fs"
    meta: LocalService = request.getfixturevalue("metadata_service")
    options = {
        "path": str(tmp_path / "3fs-data"),
        **THREEFS_GEOMETRY,
        **meta.options,
        "timeout_s": THREEFS_TIMEOUT_S,
    }
    return name, options, {}


# ---- the engine processes ----------------------------------------------------------------------


def _job(target: Target, policy: PrefetchPolicy, **extra: Any) -> dict[str, Any]:
    name, options, env = target
    return {
        "backend": name,
        "options": options,
        "env": env,
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "write_policy": WritePolicy.WRITE_THROUGH.value,
        "prefetch_policy": policy.value,
        "device_tokens": 128,
        "host_tokens": 192,
        **extra,
    }


def _start(
    context: multiprocessing.context.BaseContext, job: dict[str, Any], result: Path
) -> BaseProcess:
    process: BaseProcess = context.Process(  # type: ignore[attr-defined]
        target=serve_job, args=(json.dumps(job), str(result)), name=f"engine-{result.stem}"
    )
    process.start()
    return process


def _finish(process: BaseProcess, result: Path) -> dict[str, Any]:
    process.join(CHILD_TIMEOUT_S)
    if process.is_alive():
        process.kill()  # this test's own child, by its PID
        process.join()
        pytest.fail(f"{process.name} did not finish within {CHILD_TIMEOUT_S} s")
    assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
    outcome: dict[str, Any] = json.loads(result.read_text())
    assert outcome["threads_alive"] == 0 and outcome["locked_tokens"] == 0
    return outcome


def _run(
    context: multiprocessing.context.BaseContext, job: dict[str, Any], result: Path
) -> dict[str, Any]:
    return _finish(_start(context, job, result), result)


@pytest.mark.parametrize(
    "target", ["file", "redis", "mooncake", "s3", "3fs"], indirect=True, ids=str
)
def test_second_process_is_served_from_the_storage_the_first_wrote(
    forkserver: multiprocessing.context.BaseContext,
    target: Target,
    expected: list[list[int]],
    tmp_path: Path,
) -> None:
    first = _run(forkserver, _job(target, PrefetchPolicy.WAIT_COMPLETE), tmp_path / "first.json")
    assert first["outputs"] == expected
    assert first["stats"]["pages_stored"] > 0 and first["stats"]["backups_failed"] == 0

    second = _run(forkserver, _job(target, PrefetchPolicy.WAIT_COMPLETE), tmp_path / "second.json")
    assert second["outputs"] == expected
    assert len({os.getpid(), first["pid"], second["pid"]}) == 3, "three distinct processes"
    stats = second["stats"]
    assert stats["storage_hit_tokens"] > 0 and stats["pages_fetched"] > 0
    # Every prompt's first whole pages were stored by process 1, so process 2's first lookup of
    # each conversation is served from storage rather than recomputed.
    assert stats["storage_misses"] == 0


def test_second_process_started_while_the_first_serves_gives_the_tokens_of_recompute(
    forkserver: multiprocessing.context.BaseContext,
    expected: list[list[int]],
    tmp_path: Path,
) -> None:
    target: Target = ("file", {"root": str(tmp_path / "l3")}, {})
    half, started = tmp_path / "first-half-served", tmp_path / "second-started"
    first = _start(
        forkserver,
        _job(
            target,
            PrefetchPolicy.WAIT_COMPLETE,
            pause_after=len(PROMPTS) // 2,
            touch=str(half),
            wait_for=str(started),
        ),
        tmp_path / "first.json",
    )
    second: BaseProcess | None = None
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not half.exists():
            assert first.is_alive() or half.exists(), f"process 1 exited with {first.exitcode}"
            assert time.monotonic() < deadline, "process 1 never served half of its prompts"
            time.sleep(0.01)
        second = _start(
            forkserver,
            _job(target, PrefetchPolicy.WAIT_COMPLETE, announce=str(started)),
            tmp_path / "second.json",
        )
        # Process 1 serves its second half only once process 2 has started serving: they overlap.
        outcomes = [
            _finish(first, tmp_path / "first.json"),
            _finish(second, tmp_path / "second.json"),
        ]
    finally:
        for process in (first, second):
            if process is not None and process.is_alive():
                process.kill()  # this test's own child, by its PID
                process.join()
    assert [o["outputs"] for o in outcomes] == [expected, expected]
