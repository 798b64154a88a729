"""The engine benchmark: four cache configurations, the same tokens, the hits each tier adds."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hicache_storage.cli import main
from hicache_storage.engine.bench import (
    RUNS,
    BenchConfig,
    BenchResult,
    RunResult,
    plot_ttft_by_round,
    run_bench,
)
from hicache_storage.errors import ConfigError, MissingDependencyError

# One request at a time, in order, waiting for every storage read: the hits are deterministic.
# Four histories of up to ~50 tokens overflow a 64-token device pool and a 96-token host pool.
SMALL = BenchConfig(
    clients=4,
    rounds=3,
    system_tokens=12,
    turn_tokens=(6, 12),
    document_tokens=40,
    question_tokens=4,
    max_new_tokens=3,
    page_size=4,
    device_tokens=64,
    host_tokens=96,
    chunk_tokens=64,
    concurrency=1,
    prefetch_policy="wait_complete",
)

CLI_SMALL = [
    "--clients", "4", "--rounds", "3", "--system-tokens", "12", "--turn-tokens", "6,12",
    "--max-new-tokens", "3", "--page-size", "4", "--device-tokens", "64", "--host-tokens", "96",
    "--concurrency", "1", "--prefetch-policy", "wait_complete",
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def memory_result() -> BenchResult:
    return run_bench(SMALL)


def outputs(run: RunResult) -> dict[tuple[int, int], list[int]]:
    return {(r.client, r.round): r.output for r in run.records}


def test_run_bench_runs_the_four_configurations_in_order(memory_result: BenchResult) -> None:
    assert [run.name for run in memory_result.runs] == [name for name, _ in RUNS]
    turns = SMALL.clients * SMALL.rounds
    for run in memory_result.runs:
        assert run.requests == len(run.records) == turns
        assert run.generated_tokens == turns * SMALL.max_new_tokens
        assert len(run.ttft_by_round_s) == SMALL.rounds
        assert run.forwards > 0 and run.wall_s > 0


def test_run_bench_cached_configurations_give_the_no_cache_tokens(
    memory_result: BenchResult,
) -> None:
    reference = outputs(memory_result.run("no-cache"))
    assert len(reference) == SMALL.clients * SMALL.rounds
    for run in memory_result.runs:
        assert outputs(run) == reference
        assert run.identical
        assert run.matching_outputs == run.matching_first_tokens == run.requests


def test_run_bench_each_tier_adds_hits(memory_result: BenchResult) -> None:
    none, l1, l2, l3 = (memory_result.run(name) for name, _ in RUNS)
    assert none.hit_tokens == 0 and none.computed_tokens == none.prompt_tokens
    assert none.cache["device_hit_tokens"] == 0
    assert l1.device_hit_tokens > 0 and l1.host_hit_tokens == l1.storage_hit_tokens == 0
    assert l2.host_hit_tokens > 0 and l2.storage_hit_tokens == 0
    assert l3.storage_hit_tokens > 0
    assert l3.storage_bytes_read > 0 and l3.storage_bytes_written > 0 and l3.storage_cleared
    assert l3.computed_tokens < l2.computed_tokens < l1.computed_tokens < none.computed_tokens
    for run in (l2, l3):
        assert run.loads > 0 and run.exposed_fraction is not None
        assert run.exposed_per_layer_s is not None
    for run in memory_result.runs:
        assert run.computed_tokens + run.hit_tokens == run.prompt_tokens
        assert run.device_hit_tokens == run.cache["device_hit_tokens"]
        assert run.storage_hit_tokens == run.cache["storage_hit_tokens"]


def test_run_bench_file_backend_starts_each_run_from_an_empty_store(tmp_path: Path) -> None:
    config = dataclasses.replace(
        SMALL, backend="file", backend_config={"root": str(tmp_path / "store")}
    )
    first = run_bench(config, runs=["L1+L2+L3"])
    assert [run.name for run in first.runs] == ["no-cache", "L1+L2+L3"]
    second = run_bench(config, runs=["L1+L2+L3"])
    for result in (first, second):
        run = result.run("L1+L2+L3")
        assert run.identical and run.storage_cleared and run.storage_hit_tokens > 0
    # The pages the first run stored were cleared: the second hits exactly as much.
    assert second.run("L1+L2+L3").storage_hit_tokens == first.run("L1+L2+L3").storage_hit_tokens


def test_run_bench_documents_number_queries_as_rounds() -> None:
    config = dataclasses.replace(SMALL, workload="documents", clients=3, rounds=2)
    result = run_bench(config, runs=["L1+L2+L3"])
    run = result.run("L1+L2+L3")
    pairs = {(r.client, r.round) for r in run.records}
    assert pairs == {(doc, query) for doc in range(3) for query in range(2)}
    assert all(r.prompt_tokens == 44 for r in run.records)
    assert run.identical and run.storage_hit_tokens > 0


def test_bench_result_json_round_trips_with_its_keys(memory_result: BenchResult) -> None:
    data = memory_result.to_json(indent=2)
    assert BenchResult.from_json(data) == memory_result
    report = json.loads(data)
    assert set(report) == {
        "config",
        "model",
        "environment",
        "device_pool_bytes",
        "host_pool_bytes",
        "runs",
    }
    assert report["config"]["device_tokens"] == 64 and report["model"]["name"] == "tiny"
    assert {"date", "torch", "device"} <= set(report["environment"])
    run = report["runs"][3]
    for key in (
        "identical",
        "device_hit_tokens",
        "host_hit_tokens",
        "storage_hit_tokens",
        "computed_tokens",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "ttft_by_round_s",
        "generated_tokens_per_s",
        "total_tokens_per_s",
        "storage_bytes_read",
        "storage_bytes_written",
        "load_s",
        "exposed_load_s",
        "exposed_per_layer_s",
        "exposed_fraction",
        "forwards",
        "cache",
        "records",
    ):
        assert key in run
    assert report["device_pool_bytes"] == 64 * report["model"]["kv_bytes_per_token"]


def test_bench_result_json_masks_backend_secrets(memory_result: BenchResult) -> None:
    config = dataclasses.replace(
        memory_result.config, backend_config={"host": "h", "password": "hunter2-secret"}
    )
    data = dataclasses.replace(memory_result, config=config).to_json()
    assert b"hunter2-secret" not in data
    assert json.loads(data)["config"]["backend_config"]["host"] == "h"


def test_bench_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="model"):
        BenchConfig(model="70b")
    with pytest.raises(ConfigError, match="whole 8-token pages"):
        BenchConfig(device_tokens=100)
    with pytest.raises(ConfigError, match="write_through_everything"):
        BenchConfig(write_policy="write_through_everything")
    with pytest.raises(ConfigError, match="concurrency"):
        BenchConfig(concurrency=0)
    with pytest.raises(ConfigError, match="dtype"):
        BenchConfig(dtype="int8")
    assert BenchConfig(model="8b", dtype="float32").model_config().dtype == torch.float32
    assert BenchConfig.for_model("tiny") == BenchConfig()
    assert BenchConfig.for_model("8b", clients=2).page_size == 64


def test_run_bench_refuses_a_request_larger_than_the_device_pool() -> None:
    with pytest.raises(ConfigError, match="needs 56 device slots but the device pool has 48"):
        run_bench(dataclasses.replace(SMALL, device_tokens=48))
    with pytest.raises(ConfigError, match="unknown configurations"):
        run_bench(SMALL, runs=["L4"])


def test_plot_without_matplotlib_names_the_extra(
    memory_result: BenchResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingDependencyError, match=r"hicache-storage\[engine-bench\]"):
        plot_ttft_by_round(memory_result, tmp_path / "ttft.png")


def test_cli_engine_bench_prints_tables_and_writes_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report, plot = tmp_path / "bench.json", tmp_path / "ttft.png"
    result = CliRunner().invoke(
        main,
        ["engine", "bench", *CLI_SMALL, "--json", str(report), "--plot", str(plot), "--log-y"],
    )
    assert result.exit_code == 0, result.output
    for text in ("L1+L2+L3", "no-cache", "TTFT mean", "L3 hit", "mean TTFT (ms) by round"):
        assert text in result.stdout
    data = json.loads(report.read_text())
    assert [run["name"] for run in data["runs"]] == [name for name, _ in RUNS]
    assert all(run["identical"] for run in data["runs"])
    assert data["config"]["backend"] == "memory" and data["config"]["concurrency"] == 1
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_cli_engine_bench_json_to_stdout_with_a_scratch_file_backend() -> None:
    result = CliRunner().invoke(
        main, ["engine", "bench", *CLI_SMALL, "--backend", "file", "--json", "-"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"]["backend"] == "file" and "root" in data["config"]["backend_config"]
    assert data["runs"][3]["storage_hit_tokens"] > 0


def test_cli_engine_bench_refuses_8b_on_a_cpu_without_force() -> None:
    result = CliRunner().invoke(main, ["engine", "bench", "--model", "8b"])
    assert result.exit_code == 2
    assert "--force" in result.output and "GPU" in result.output


def test_cli_engine_bench_reports_a_too_small_device_pool() -> None:
    result = CliRunner().invoke(main, ["engine", "bench", *CLI_SMALL, "--device-tokens", "48"])
    assert result.exit_code == 2
    assert "error: round 2 of client 2 needs 56 device slots" in result.output
