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

from hicache_storage.bench.engine import (
    PARTS,
    RUNS,
    BenchConfig,
    BenchResult,
    EngineSettings,
    RunResult,
    Spread,
    Workload,
    plot_ttft_by_round,
    run_bench,
)
from hicache_storage.cli import main
from hicache_storage.engine.cache_config import CacheConfig, PrefetchConfig
from hicache_storage.engine.policies import PrefetchPolicy
from hicache_storage.errors import ConfigError, MissingDependencyError
from hicache_storage.factory import create_backend

# One request at a time, in order, waiting for every storage read: the hits are deterministic.
# Four histories of up to ~50 tokens overflow a 64-token device pool and a 96-token host pool.
SMALL = BenchConfig(
    workload=Workload(
        clients=4,
        rounds=3,
        system_tokens=12,
        turn_tokens=(6, 12),
        document_tokens=40,
        question_tokens=4,
        max_new_tokens=3,
        concurrency=1,
    ),
    engine=EngineSettings(device_tokens=64, host_tokens=96, chunk_tokens=64),
    cache=CacheConfig(4, prefetch=PrefetchConfig(policy=PrefetchPolicy.WAIT_COMPLETE)),
)

CLI_SMALL = [
    "--clients", "4", "--rounds", "3", "--set", "workload.system_tokens=12",
    "--set", "workload.turn_tokens=[6,12]", "--set", "workload.max_new_tokens=3",
    "--set", "page_size=4", "--set", "engine.device_tokens=64", "--set", "engine.host_tokens=96",
    "--set", "workload.concurrency=1", "--set", "prefetch.policy=wait_complete",
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
    workload = SMALL.workload
    turns = workload.clients * workload.rounds
    for run in memory_result.runs:
        assert run.requests == len(run.records) == turns
        assert run.generated_tokens == turns * workload.max_new_tokens
        assert len(run.ttft_by_round_s) == workload.rounds
        assert run.forwards > 0 and run.wall_s > 0


def test_run_bench_cached_configurations_give_the_no_cache_tokens(
    memory_result: BenchResult,
) -> None:
    reference = outputs(memory_result.run("no-cache"))
    assert len(reference) == SMALL.workload.clients * SMALL.workload.rounds
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
    # Something left in the store before the second run, besides the first run's pages.
    store = create_backend("file", config.backend_config)
    try:
        assert store.set("sentinel", b"left over") and store.exists("sentinel")
    finally:
        store.close()
    second = run_bench(config, runs=["L1+L2+L3"])
    for result in (first, second):
        run = result.run("L1+L2+L3")
        assert run.identical and run.storage_cleared and run.storage_hit_tokens > 0
    store = create_backend("file", config.backend_config)
    try:
        assert not store.exists("sentinel"), "the second run began on an empty store"
    finally:
        store.close()


def test_run_bench_documents_number_queries_as_rounds() -> None:
    config = SMALL.with_settings({"workload": {"kind": "documents", "clients": 3, "rounds": 2}})
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
        "rates",
        "summary",
    }
    assert report["config"]["engine"]["device_tokens"] == 64 and report["model"]["name"] == "tiny"
    assert report["config"]["cache"]["prefetch"]["policy"] == "wait_complete"
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
        "repeat",
        "costs",
        "parts_mean_s",
        "bound_mean_s",
        "ttft_over_bound",
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
    with pytest.raises(ConfigError, match=r"engine\.device_tokens \(100\) must be whole 8-token"):
        BenchConfig(engine=EngineSettings(device_tokens=100))
    with pytest.raises(ConfigError, match="whole 12-token pages"):
        BenchConfig().with_settings({"page_size": 12})
    with pytest.raises(ConfigError, match="write_through_everything"):
        BenchConfig().with_settings({"write.policy": "write_through_everything"})
    with pytest.raises(ConfigError, match=r"workload\.concurrency"):
        Workload(concurrency=0)
    with pytest.raises(ConfigError, match=r"workload\.kind"):
        Workload(kind="chat")
    with pytest.raises(ConfigError, match=r"workload\.turn_tokens"):
        Workload(turn_tokens=(8, 4))
    with pytest.raises(ConfigError, match=r"engine\.host_layout"):
        EngineSettings(host_layout="diagonal")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dtype"):
        BenchConfig(dtype="int8")
    with pytest.raises(ConfigError, match="prefix_cache"):
        BenchConfig().with_settings({"prefix_cache": False})
    assert BenchConfig(model="8b", dtype="float32").model_config().dtype == torch.float32
    assert BenchConfig.for_model("tiny") == BenchConfig()
    large = BenchConfig.for_model("8b").with_settings({"workload.clients": 2})
    assert large.cache.page_size == 64 and large.workload.clients == 2
    assert large.workload.rounds == 6, "a setting changes its own field alone"


def test_run_bench_refuses_a_request_larger_than_the_device_pool() -> None:
    with pytest.raises(ConfigError, match="needs 56 device slots but the device pool has 48"):
        run_bench(SMALL.with_settings({"engine.device_tokens": 48}))
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
    titles = ("mean TTFT (ms) by round", "the scheduler's thread")
    for text in ("L1+L2+L3", "no-cache", "TTFT mean", "L3 hit", *titles):
        assert text in result.stdout
    data = json.loads(report.read_text())
    assert [run["name"] for run in data["runs"]] == [name for name, _ in RUNS]
    assert all(run["identical"] for run in data["runs"])
    assert data["config"]["backend"] == "memory" and data["config"]["workload"]["concurrency"] == 1
    assert plot.read_bytes().startswith(b"\x89PNG")
    stored = data["runs"][-1]
    shortfall = result.stdout.split("where storage fell short")[1]
    row = next(line for line in shortfall.splitlines() if "L1+L2+L3" in line)
    *cells, shed = row.split("│")[2:-1]
    counts = [int(cell.replace(",", "")) for cell in cells]
    names = ("prefetches", "prefetch_priced_out", "prefetch_no_room", "prefetch_pages_cut")
    assert counts == [stored["cache"][name] for name in (*names, "pages_dropped")]
    by_rule = sorted(stored["cache"]["backup_pages_shed"].items())
    assert shed.strip() == (", ".join(f"{rule} {pages:,}" for rule, pages in by_rule) or "0")
    assert set(stored["planner"]) == {"fetch_pages", "write_pages", "gate", "rates"}
    assert counts[0] > 0, "the storage run fetched"


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
    result = CliRunner().invoke(
        main, ["engine", "bench", *CLI_SMALL, "--set", "engine.device_tokens=48"]
    )
    assert result.exit_code == 2
    assert "error: round 2 of client 2 needs 56 device slots" in result.output


def test_every_request_says_where_its_time_went_and_what_bounds_it(
    memory_result: BenchResult,
) -> None:
    rates = memory_result.rates
    assert rates is not None and rates.raw_read_gbps and rates.raw_read_gbps > 0
    assert rates.host_to_device_gbps > 0 and rates.compute_s_per_token
    for run in memory_result.runs:
        for record in run.records:
            parts = [getattr(record, f"{part}_s") for part in PARTS]
            assert all(part >= 0 for part in parts)
            assert sum(parts) == pytest.approx(record.ttft_s, abs=1e-6)
            assert record.bound_s is not None and record.bound_s > 0
        if run.name in ("no-cache", "L1", "L1+L2"):
            assert run.parts_mean_s["storage_query"] == run.parts_mean_s["storage_read"] == 0
        assert run.ttft_over_bound == pytest.approx(run.ttft_mean_s / run.bound_mean_s)
    stored = memory_result.run("L1+L2+L3")
    assert any(r.storage_hit for r in stored.records)
    assert stored.bound_mean_s < memory_result.run("no-cache").bound_mean_s, (
        "storage hits make the bound lower than recomputing everything"
    )


def test_every_forward_is_a_step_that_says_where_the_scheduler_spent_it(
    memory_result: BenchResult,
) -> None:
    for run in memory_result.runs:
        steps = run.steps
        assert len(steps) == run.forwards > 0
        assert sum(s.prefill_tokens for s in steps) == run.computed_tokens
        assert sum(s.decode_tokens for s in steps) == run.generated_tokens - run.requests
        assert sum(s.admitted for s in steps) == run.requests
        starts = [s.started for s in steps]
        assert starts == sorted(starts) and starts[0] >= 0 and starts[-1] <= run.wall_s
        for step in steps:
            assert min(step.poll_s, step.admit_s, step.forward_s, step.finish_s, step.gc_s) >= 0
            assert step.context_tokens >= step.prefill_tokens + step.decode_tokens
        loaded = sum(s.loaded_tokens for s in steps)
        assert loaded == run.cache["pages_loaded"] * SMALL.cache.page_size
        assert sum(s.exposed_load_s for s in steps) == pytest.approx(run.exposed_load_s)
        assert sum(s.host_wait_s for s in steps) <= run.cache["host_room_wait_s"] + 1e-9
        if run.name != "L1+L2+L3":
            assert all(s.write_backlog_tokens == 0 for s in steps)
            assert all(s.read_s_per_page is None for s in steps)
    stored = memory_result.run("L1+L2+L3")
    assert any(s.read_s_per_page for s in stored.steps), "reads were measured as they ran"
    assert stored.steps[-1].write_backlog_tokens >= 0


def test_storage_runs_say_what_their_queries_found_and_what_the_backend_did(
    memory_result: BenchResult,
) -> None:
    for run in memory_result.runs:
        for record in run.records:
            assert 0 <= record.storage_hit <= record.storage_found <= record.prompt_tokens
        if run.name != "L1+L2+L3":
            assert run.storage_stats == {}
            assert all(r.storage_found == 0 for r in run.records)
    stored = memory_result.run("L1+L2+L3")
    found = sum(r.storage_found for r in stored.records)
    assert found >= stored.storage_hit_tokens > 0
    ops = stored.storage_stats["ops"]
    assert ops["batch_get_v1"]["calls"] > 0 and ops["batch_get_v1"]["hit"] > 0
    assert ops["batch_set_v1"]["ok"] == stored.cache["pages_stored"]
    assert "degraded" not in stored.storage_stats, "a healthy store reports no failures"
    fetches = stored.cache["prefetches"]
    assert stored.cache["prefetch_priced_out"] + stored.cache["prefetch_no_room"] <= fetches


def test_a_chain_run_records_each_tier_and_the_first_tiers_rule(tmp_path: Path) -> None:
    tiers = [
        {"backend": "memory"},
        {"backend": "file", "options": {"root": str(tmp_path / "far")}},
    ]
    config = dataclasses.replace(SMALL, backend="chain", backend_config={"tiers": tiers})
    stored = run_bench(config, runs=["L1+L2+L3"]).run("L1+L2+L3")
    stats = stored.storage_stats
    assert [tier["backend"] for tier in stats["tiers"]] == ["memory", "file"]
    served = sum(tier["hits"] for tier in stats["tiers"])  # the pages' verify records too
    assert served >= stats["ops"]["batch_get_v1"]["hit"] > 0
    far = stats["tiers"][1]["ops"]["batch_set_v1"]
    held = stats["writes"]["pages"]["held"]  # written again: the tiers keep the first value
    assert far["ok"] + held == stored.cache["pages_stored"], "written through to the far tier"
    assert stats["first_tier"]["pages"]["placed"] > 0


def test_repeats_are_summarised_by_median_and_range() -> None:
    result = run_bench(dataclasses.replace(SMALL, repeat=3), runs=["L1+L2"])
    assert [(r.name, r.repeat) for r in result.runs] == [
        ("no-cache", 0), ("L1+L2", 0), ("no-cache", 1), ("L1+L2", 1), ("no-cache", 2),
        ("L1+L2", 2),
    ]  # fmt: skip
    assert all(r.identical for r in result.runs)
    for summary in result.summary:
        means = sorted(r.ttft_mean_s for r in result.runs if r.name == summary.name)
        assert summary.repeats == 3
        assert (summary.ttft_mean_s.low, summary.ttft_mean_s.median, summary.ttft_mean_s.high) == (
            pytest.approx(means[0]), pytest.approx(means[1]), pytest.approx(means[2]),
        )  # fmt: skip
        rounds = [s for s in summary.ttft_by_round_s if s is not None]
        assert len(rounds) == SMALL.workload.rounds and all(
            s.low <= s.median <= s.high for s in rounds
        )
    assert BenchResult.from_json(result.to_json()) == result


def test_the_tables_name_the_repeat_they_show_and_a_wide_spread_is_warned() -> None:
    from rich.console import Console

    from hicache_storage.cli.engine import render

    result = run_bench(dataclasses.replace(SMALL, repeat=2), runs=["L1+L2"])

    def printed() -> str:
        console = Console(record=True, width=400)
        render(result, console)
        return console.export_text()

    for summary in result.summary:
        summary.ttft_mean_s = Spread(median=0.0100, low=0.0100, high=0.0102)
    narrow = printed()
    assert "repeat 1 of 2 (medians below)" in narrow and "spread" not in narrow
    result.summary[1].ttft_mean_s = Spread(median=0.0125, low=0.0100, high=0.0150)
    wide = printed()
    assert f"warning: {result.summary[1].name}: mean TTFT spread 10.0-15.0 ms" in wide
    assert f"warning: {result.summary[0].name}: mean" not in wide


def test_a_hugging_face_config_gives_the_model_its_shape(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "intermediate_size": 96, "rope_theta": 1e6,
                "rms_norm_eps": 1e-6, "torch_dtype": "float32",
            }
        )
    )  # fmt: skip
    config = BenchConfig.for_model(str(path)).with_settings(
        {"engine.device_tokens": 256, "engine.host_tokens": 256, "page_size": 8}
    )
    shape = config.model_config()
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (
        64, 2, 4, 2, 32,
    )  # fmt: skip
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    small = dataclasses.replace(SMALL, model=str(path))
    result = run_bench(small, runs=["L1+L2"])
    assert result.model["hidden"] == 64 and all(r.identical for r in result.runs)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"model_type": "gpt2", "n_embd": 8}', "model_type"),
        ('{"model_type": "llama", "hidden_size": 64}', "lacks"),
        ("[1, 2]", "JSON object"),
        ("{not json", "cannot be read"),
    ],
)
def test_a_config_json_that_is_not_a_supported_model_is_refused(
    tmp_path: Path, content: str, match: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        BenchConfig(model=str(path))
    with pytest.raises(ConfigError, match=r"config\.json path"):
        BenchConfig(model=str(tmp_path / "missing.json"))


def test_the_70b_layer_shape_is_llama_3_70b_per_layer() -> None:
    shape = BenchConfig.for_model("70b-layers").model_config()
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.intermediate) == (
        8192, 64, 8, 28672,
    )  # fmt: skip
    assert shape.layers == 20 and shape.kv_bytes_per_token == 80 * 1024


def test_the_write_width_reaches_the_cache_and_is_checked() -> None:
    """``--set write.batch_bytes`` sets the cache's option; unset, the cache keeps its default."""
    from hicache_storage.bench.engine import _build_cache

    wide = _build_cache(BenchConfig().with_settings({"write.batch_bytes": 1 << 26}), "L1+L2", None)
    plain = _build_cache(BenchConfig(), "L1+L2", None)
    try:
        assert wide.config.write.batch_bytes == 1 << 26
        assert plain.config.write.batch_bytes == CacheConfig(8).write.batch_bytes
    finally:
        wide.close()
        plain.close()
    with pytest.raises(ConfigError, match=r"write\.batch_bytes"):
        BenchConfig().with_settings({"write.batch_bytes": 0})
    result = CliRunner().invoke(main, ["engine", "bench", "--set", "write.batch_bytes=0"])
    assert result.exit_code == 2 and "write.batch_bytes" in result.stderr


def test_idle_writes_reaches_the_cache_and_is_checked() -> None:
    """``--set threads.idle_writes=false`` turns the cache's option off; by default it is on."""
    from hicache_storage.bench.engine import _build_cache

    off = _build_cache(BenchConfig().with_settings({"threads.idle_writes": False}), "L1+L2", None)
    plain = _build_cache(BenchConfig(), "L1+L2", None)
    try:
        assert off.config.threads.idle_writes is False
        assert plain.config.threads.idle_writes is CacheConfig(8).threads.idle_writes is True
    finally:
        off.close()
        plain.close()
    with pytest.raises(ConfigError, match="idle_writes"):
        BenchConfig().with_settings({"threads.idle_writes": 1})
    result = CliRunner().invoke(main, ["engine", "bench", "--set", "threads.idle_writes=1"])
    assert result.exit_code == 2 and "threads.idle_writes" in result.stderr


def test_managed_gc_is_on_by_default_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's engines run the collector between steps unless ``engine.managed_gc=false``."""
    import gc

    from hicache_storage.bench import engine as bench_engine

    seen: list[tuple[bool, bool]] = []
    made = bench_engine.Engine

    class Watching(made):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, managed_gc: bool = False, **kwargs: object) -> None:
            super().__init__(*args, managed_gc=managed_gc, **kwargs)  # type: ignore[arg-type]
            seen.append((managed_gc, gc.isenabled()))

    monkeypatch.setattr(bench_engine, "Engine", Watching)
    small = SMALL.with_settings({"workload.rounds": 1, "workload.clients": 2, "warmup": False})
    run_bench(small, runs=["L1+L2"])
    run_bench(small.with_settings({"engine.managed_gc": False}), runs=["L1+L2"])
    assert seen == [(True, False)] * 2 + [(False, True)] * 2, "no-cache and L1+L2, each way"
    assert gc.isenabled() and gc.get_freeze_count() == 0, "every engine gave it back"
    with pytest.raises(ConfigError, match="managed_gc"):
        EngineSettings(managed_gc=1)  # type: ignore[arg-type]
    result = CliRunner().invoke(main, ["engine", "bench", "--set", "engine.managed_gc=1"])
    assert result.exit_code == 2 and "engine.managed_gc" in result.stderr


def test_each_configuration_is_warmed_once_on_a_store_it_leaves_empty(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before its first repeat, every configuration serves the first clients' turns untimed.

    The warm-up has pools of its own and starts on an emptied store, as every timed run does.
    """
    from hicache_storage.bench import engine as bench_engine

    root = tmp_path / "store"
    served: list[tuple[int, int]] = []  # (clients, turns) of every drive
    stored_at_build: list[int] = []  # files in the store as each storage cache is built
    drive, build_cache = bench_engine._drive, bench_engine._build_cache

    def counting(engine: object, config: BenchConfig, turns: list, *args: object) -> object:  # type: ignore[type-arg]
        served.append((len({t.client for t in turns}), len(turns)))
        return drive(engine, config, turns, *args)  # type: ignore[arg-type]

    def building(config: BenchConfig, name: str, backend: object) -> object:
        if backend is not None:
            stored_at_build.append(sum(1 for p in root.rglob("*") if p.is_file()))
        return build_cache(config, name, backend)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_engine, "_drive", counting)
    monkeypatch.setattr(bench_engine, "_build_cache", building)
    small = dataclasses.replace(
        SMALL, repeat=2, backend="file", backend_config={"root": str(root)}
    ).with_settings({"workload.clients": 3, "workload.concurrency": 2})
    everything, two = (3, 3 * SMALL.workload.rounds), (2, 2 * SMALL.workload.rounds)
    run_bench(dataclasses.replace(small, warmup=False), runs=["L1+L2+L3"])
    assert served == [everything] * 4, "no warm-up: no-cache and L1+L2+L3, twice"
    assert any(p.is_file() for p in root.rglob("*")), "the last run left its pages"
    served.clear()
    stored_at_build.clear()
    warmed = run_bench(small, runs=["L1+L2+L3"])
    assert served == [two, everything, two, everything, everything, everything]
    assert stored_at_build == [0, 0, 0], "warm-up, first and second timed run: an empty store"
    assert all(run.identical for run in warmed.runs)
