"""The never-worse matrix: cells built from one base, ratios over the right baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hicache_storage.bench.engine import BenchConfig, run_benches
from hicache_storage.bench.matrix import (
    FAILING_STORE,
    GOAL,
    CellResult,
    cell_config,
    cells,
    run_matrix,
)
from hicache_storage.cli import main
from hicache_storage.errors import ConfigError

BASE = BenchConfig.for_model("tiny", warmup=False).with_settings(
    {"workload": {"kind": "documents", "clients": 3, "rounds": 2, "document_tokens": 64}}
)


def test_cells_cover_every_combination_and_a_failing_store_per_model() -> None:
    grid = cells(["tiny", "8b"], [0.5, 2], ["write_through", "write_back"], ["adaptive"])
    assert len(grid) == 2 * 2 * 2 + 2
    failing = [cell for cell in grid if cell.failing]
    assert [cell.model for cell in failing] == ["tiny", "8b"]
    assert "failing store" in failing[0].label


def test_a_model_file_is_labelled_by_its_name_a_config_json_by_its_directory() -> None:
    shapes = ["scripts/models/mha-13b-20-layers.json", "/m/llama-7b/config.json", "8b"]
    labels = [cell.label for cell in cells(shapes, [2], ["write_through"], ["adaptive"])]
    assert [label.split(" host ")[0] for label in labels[:3]] == [
        "mha-13b-20-layers",
        "llama-7b",
        "8b",
    ]


def test_a_cell_sets_the_host_pool_by_its_ratio_in_whole_pages() -> None:
    grid = cells(["tiny"], [0.5, 3], ["write_back"], ["timeout"])
    half, triple, failing = (cell_config(BASE, cell) for cell in grid)
    assert half.engine.host_tokens == BASE.engine.device_tokens // 2
    assert triple.engine.host_tokens == 3 * BASE.engine.device_tokens
    assert (half.cache.write.policy, half.cache.prefetch.policy) == ("write_back", "timeout")
    assert half.faults is None and failing.faults == FAILING_STORE
    assert half.engine.host_tokens % BASE.cache.page_size == 0
    assert half.workload == BASE.workload and half.engine.device_tokens == BASE.engine.device_tokens
    with pytest.raises(ConfigError, match="no host page"):
        cell_config(BASE, cells(["tiny"], [0.001], ["write_back"], ["timeout"])[0])


def test_the_matrix_reports_the_tier_over_the_better_baseline() -> None:
    grid = cells(["tiny"], [2.0], ["write_through"], ["adaptive"])
    result = run_matrix(BASE, grid)
    served, failing = result.cells
    assert served.baseline in ("no-cache", "L1+L2")
    assert served.mean_ratio == pytest.approx(
        served.ttft_mean_s["L1+L2+L3"]
        / min(served.ttft_mean_s["no-cache"], served.ttft_mean_s["L1+L2"])
    )
    assert served.identical, "every configuration serves the no-cache tokens"
    assert served.goal == GOAL
    assert failing.baseline == "L1+L2" and failing.storage_hit_tokens == 0
    assert failing.mean_ratio == pytest.approx(
        failing.ttft_mean_s["L1+L2+L3"] / failing.ttft_mean_s["L1+L2"]
    )
    stored = json.loads(result.to_json())
    assert [cell["cell"]["failing"] for cell in stored] == [False, True]


def test_the_command_prints_every_cell_and_writes_json(tmp_path: Path) -> None:
    out, details = tmp_path / "matrix.json", tmp_path / "cells.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "engine", "matrix", "--backend", "memory", "--ratios", "1", "--write-policies",
            "write_back", "--no-failing", "--clients", "2", "--rounds", "2", "--set",
            "workload.document_tokens=64", "--json", str(out), "--details", str(details),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tiny host 1x write_back/adaptive" in result.output
    assert len(json.loads(out.read_bytes())) == 1
    (line,) = details.read_bytes().splitlines()
    cell = json.loads(line)
    assert cell["cell"]["cell"]["write_policy"] == "write_back"
    runs = {run["name"]: run for run in cell["runs"]}
    assert set(runs) == {"no-cache", "L1+L2", "L1+L2+L3"}
    assert all(run["records"] == [] and run["steps"] == [] for run in runs.values())
    assert runs["L1+L2+L3"]["parts_mean_s"] and "gate" in runs["L1+L2+L3"]["planner"]
    bad = CliRunner().invoke(main, ["engine", "matrix", "--write-policies", "sometimes"])
    assert bad.exit_code == 2 and "--write-policies" in bad.output
    typo = CliRunner().invoke(main, ["engine", "matrix", "--set", "workload.documents=64"])
    assert typo.exit_code == 2 and "document_tokens" in typo.stderr


def test_an_isolated_cell_runs_in_a_child_process_and_reports_the_same_figures() -> None:
    grid = cells(["tiny"], [1.0], ["write_through"], ["adaptive"], failing=False)
    (cell,) = run_matrix(BASE, grid, isolate=True).cells
    assert cell.result is not None and cell.identical
    assert {run.name for run in cell.result.runs} == {"no-cache", "L1+L2", "L1+L2+L3"}
    assert cell.result.runs[0].records, "the child's per-request records come back"
    assert cell.mean_ratio == pytest.approx(
        cell.ttft_mean_s["L1+L2+L3"] / cell.ttft_mean_s[cell.baseline]
    )


def test_a_models_cells_share_its_no_cache_run_and_each_host_pools_l1_l2_run() -> None:
    grid = cells(["tiny"], [1.0, 2.0], ["write_through"], ["adaptive", "best_effort"])
    result = run_matrix(BASE, grid)
    assert len(result.cells) == len(grid) == 5
    runs = [cell.result.runs for cell in result.cells if cell.result is not None]
    no_cache = {id(run) for served in runs for run in served if run.name == "no-cache"}
    assert len(no_cache) == 1, "one no-cache run serves the whole model"
    host_only = {
        (cell.cell.host_ratio, id(run))
        for cell in result.cells
        if cell.result is not None
        for run in cell.result.runs
        if run.name == "L1+L2"
    }
    assert sorted(ratio for ratio, _ in host_only) == [1.0, 2.0], "one L1+L2 run per host pool"
    tiers = [run for served in runs for run in served if run.name == "L1+L2+L3"]
    assert len({id(run) for run in tiers}) == 5, "every cell serves its own tier run"
    for cell in result.cells:
        names = ["L1+L2"] if cell.cell.failing else ["no-cache", "L1+L2"]
        baseline = min(cell.ttft_mean_s[name] for name in names)
        assert cell.mean_ratio == pytest.approx(cell.ttft_mean_s["L1+L2+L3"] / baseline)


def test_the_jobs_of_one_model_run_must_share_the_model_and_workload() -> None:
    other = BASE.with_settings({"workload.document_tokens": 128})
    with pytest.raises(ConfigError, match="workload"):
        run_benches([(BASE, ["L1+L2"]), (other, ["L1+L2"])])


def test_an_isolated_model_streams_each_cell_and_a_child_error_reaches_the_caller() -> None:
    grid = cells(["tiny"], [1.0, 2.0], ["write_through"], ["adaptive"], failing=False)
    seen: list[float] = []

    def done(cell: CellResult) -> None:
        seen.append(cell.cell.host_ratio)

    first, second = run_matrix(BASE, grid, isolate=True, done=done).cells
    assert seen == [1.0, 2.0]
    assert first.ttft_mean_s["no-cache"] == second.ttft_mean_s["no-cache"]
    assert first.result is not None and second.result is not None
    assert first.result.run("L1+L2") is not second.result.run("L1+L2")
    too_long = BASE.with_settings({"workload.document_tokens": 1 << 20})
    with pytest.raises(ConfigError):
        run_matrix(too_long, grid[:1], isolate=True)
