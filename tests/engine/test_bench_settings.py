"""The engine bench's settings: every field by its dotted path, from Python, --set or a file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import msgspec
import pytest
from click.testing import CliRunner, Result

from hicache_storage.bench.engine import BenchConfig, Workload
from hicache_storage.cli import engine as engine_cli
from hicache_storage.cli import main
from hicache_storage.config import FaultConfig, FaultRule
from hicache_storage.engine.policies import PrefetchPolicy, WritePolicy
from hicache_storage.errors import ConfigError

# Every group changed, with values of every kind a field holds: enums, tuples, None, a record.
CHANGED = BenchConfig().with_settings(
    {
        "workload": {"kind": "documents", "clients": 3, "turn_tokens": [4, 9], "seed": 7},
        "workload.arrival_rate": 2.5,
        "workload.concurrency": None,
        "engine": {"host_layout": "page_first", "managed_gc": False, "device_tokens": 128},
        "page_size": 16,
        "write": {"policy": "write_back", "batch_bytes": 1 << 20},
        "prefetch": {"policy": "timeout", "timeout": {"base_s": 1.5}, "capacity": 64},
        "threads.nice": None,
        "cache.transfer.sms": None,
        "faults": {"default": {"failure_rate": 0.5}},
        "read_delay_s": 0.01,
        "repeat": 2,
        "warmup": False,
        "dtype": "float32",
    }
)


class Ran(Exception):
    """Raised in place of a run, carrying the config the command would have run."""

    def __init__(self, config: BenchConfig) -> None:
        super().__init__()
        self.config = config


@pytest.fixture(autouse=True)
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def ran(config: BenchConfig, **kwargs: Any) -> None:
        raise Ran(config)

    monkeypatch.setattr(engine_cli, "run_bench", ran)


def leaves(record: object, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every field of ``record`` that is not a group, by its dotted path."""
    assert dataclasses.is_dataclass(record)
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{field.name}.")
        else:
            yield prefix + field.name, value


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["engine", "bench", *args])


def ran(result: Result) -> BenchConfig:
    assert isinstance(result.exception, Ran), result.output
    return result.exception.config


def test_the_settings_reach_every_group_as_their_types() -> None:
    assert CHANGED.workload.turn_tokens == (4, 9) and CHANGED.workload.concurrency is None
    assert CHANGED.cache.write.policy is WritePolicy.WRITE_BACK
    assert CHANGED.cache.prefetch.policy is PrefetchPolicy.TIMEOUT
    assert CHANGED.cache.prefetch.timeout.base_s == 1.5 and CHANGED.cache.transfer.sms is None
    assert CHANGED.faults == FaultConfig(default=FaultRule(failure_rate=0.5))
    assert CHANGED.cache.write.backlog == BenchConfig().cache.write.backlog, "others kept"


def test_every_field_has_a_path_that_sets_it_from_the_command_line() -> None:
    """Each field, at its JSON, through ``--set``: the paths are the config's own fields."""
    paths = dict(leaves(CHANGED))
    assert {"workload.seed", "engine.host_layout", "cache.write.linger_s"} <= set(paths)
    args = [f"{path}={msgspec.json.encode(value).decode()}" for path, value in paths.items()]
    assert ran(bench(*(word for arg in args for word in ("--set", arg)))) == CHANGED
    assert CHANGED.with_settings(dict(leaves(BenchConfig()))) == BenchConfig()


def test_a_settings_file_in_json_or_toml_is_the_same_as_its_sets(tmp_path: Path) -> None:
    sets = [
        "model=tiny",
        "workload.clients=3",
        "write.policy=write_back",
        "engine.device_tokens=128",
    ]
    expected = ran(bench(*(word for arg in sets for word in ("--set", arg))))
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "model": "tiny",
                "workload": {"clients": 3},
                "write.policy": "write_back",
                "engine": {"device_tokens": 128},
            }
        )
    )
    (tmp_path / "run.toml").write_text(
        'model = "tiny"\n"write.policy" = "write_back"\n'
        "[workload]\nclients = 3\n[engine]\ndevice_tokens = 128\n"
    )
    for name in ("run.json", "run.toml"):
        assert ran(bench("--settings", str(tmp_path / name))) == expected
    assert expected.workload.clients == 3 and expected.engine.device_tokens == 128


def test_later_settings_win_and_the_options_win_over_them(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text('{"workload": {"clients": 3, "rounds": 2}}')
    config = ran(bench("--settings", str(tmp_path / "run.json"), "--set", "workload.clients=5"))
    assert (config.workload.clients, config.workload.rounds) == (5, 2)
    config = ran(bench("--set", "workload.clients=5", "--clients", "6", "--set", "repeat=3"))
    assert config.workload.clients == 6 and config.repeat == 3
    whole = BenchConfig().with_settings([("workload", Workload(clients=3)), ("workload.rounds", 2)])
    assert (whole.workload.clients, whole.workload.rounds) == (3, 2)


def test_a_model_other_than_tiny_by_setting_still_asks_for_a_gpu() -> None:
    result = bench("--set", "model=8b")
    assert result.exit_code == 2 and "--force" in result.output


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("write.polcy=write_back", "unknown setting 'write.polcy': 'write' has policy, "),
        ("workload.clientz=3", "'workload' has kind, clients, rounds"),
        ("wrkload.clients=3", "the settings are backend, "),
        ("repeat.times=3", "'repeat' has no fields"),
        ("write.policy=sometimes", "(one of write_through, write_through_selective, write_back)"),
        ("workload.clients=many", "setting workload.clients='many': Expected `int`, got `str`"),
        ("engine.device_tokens=100", "engine.device_tokens (100) must be whole 8-token pages"),
        ("model=3", "setting model must be a string"),
        ("noequals", "--set takes PATH=VALUE"),
    ],
)
def test_a_wrong_setting_is_one_line_naming_it_and_exit_2(setting: str, message: str) -> None:
    result = bench("--set", setting)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line


def test_a_setting_that_names_no_field_is_refused_in_python_too() -> None:
    with pytest.raises(ConfigError, match=r"'prefetch' has policy, timeout\.\*, threshold"):
        BenchConfig().with_settings({"prefetch.deadline": 1})


def test_the_bench_takes_its_settings_by_path_not_an_option_each() -> None:
    """Issue 49: at most half of the 38 options the bench had when each setting was one."""
    group = main.get_command(click.Context(main), "engine")
    assert isinstance(group, click.Group)
    command = group.commands["bench"]
    options = [param for param in command.params if isinstance(param, click.Option)]
    assert len(options) <= 19
