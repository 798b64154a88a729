"""``hicache`` starts without the engine: light commands never import torch.

Every command but the engine's and the kernels' works from the registry and the backends;
importing torch costs seconds, so the group imports a subcommand's module only when it runs.
"""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from hicache_storage.cli.main import COMMANDS, main

PROBE = """
import sys
from hicache_storage.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "hicache_storage.engine", "hicache_storage.bench.engine")
               if m in sys.modules)
print("HEAVY", code, ",".join(heavy) or "-", file=sys.stderr)
"""


def _run(*args: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120
    )
    line = [row for row in done.stderr.splitlines() if row.startswith("HEAVY ")]
    assert line, done.stderr[-2000:]
    _, code, heavy = line[-1].split(" ")
    return code, heavy


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--version"], id="version"),
        pytest.param(["--help"], id="help"),
        pytest.param(["backends", "--json"], id="backends"),
        pytest.param(["check", "--help"], id="check-help"),
        pytest.param(["bench", "--help"], id="bench-help"),
        pytest.param(["sglang-args", "memory"], id="sglang-args"),
        pytest.param(["vllm-args", "memory"], id="vllm-args"),
    ],
)
def test_light_commands_import_no_torch(args: list[str]) -> None:
    code, heavy = _run(*args)
    assert code == "0"
    assert heavy == "-", f"hicache {' '.join(args)} imported {heavy}"


def test_the_engine_command_still_loads_the_engine() -> None:
    code, heavy = _run("engine", "bench", "--help")
    assert code == "0"
    assert "hicache_storage.bench.engine" in heavy.split(",")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_listed_command_loads_with_the_help_the_listing_shows(name: str) -> None:
    command = main.get_command(click.Context(main), name)
    assert command is not None and command.name == name
    assert command.get_short_help_str(300) == COMMANDS[name][2]


def test_help_lists_every_command_once() -> None:
    text = main.get_help(click.Context(main, info_name="hicache"))
    rows = text.split("Commands:")[1].splitlines()
    listed = [row.split()[0] for row in rows if row.startswith("  ") and row[2] != " "]
    assert listed == sorted(set(listed))
    assert set(COMMANDS) <= set(listed)
