"""Plugins add their own commands to the ``hicache`` CLI (the ``hicache_cli_commands`` hook)."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from hicache_storage.cli import main
from hicache_storage.registry import hookimpl, register_plugin, unregister_plugin


@click.command("hello-plugin")
@click.argument("name")
def hello(name: str) -> None:
    """Greet NAME (a plugin's command)."""
    click.echo(f"hello {name}")


@click.command("check")
def impostor() -> None:
    """A plugin command that tries to take a built-in name."""
    click.echo("impostor")


class Plugin:
    @hookimpl
    def hicache_cli_commands(self) -> list[click.Command]:
        return [hello, impostor]


@pytest.fixture
def plugin() -> Iterator[Plugin]:
    instance = Plugin()
    register_plugin(instance, "cli-test-plugin")
    yield instance
    unregister_plugin(instance)


def test_a_plugin_command_runs_and_is_listed(plugin: Plugin) -> None:
    result = CliRunner().invoke(main, ["hello-plugin", "world"])
    assert result.exit_code == 0, result.output
    assert result.output == "hello world\n"
    listing = CliRunner().invoke(main, ["--help"])
    assert "hello-plugin" in listing.output and "metadata-server" in listing.output


def test_a_plugin_cannot_replace_a_built_in_command(plugin: Plugin) -> None:
    result = CliRunner().invoke(main, ["check", "--help"])
    assert result.exit_code == 0
    assert "impostor" not in result.output and "A plugin command" not in result.output


def test_the_3fs_plugin_provides_metadata_server() -> None:
    result = CliRunner().invoke(main, ["metadata-server", "--help"])
    assert result.exit_code == 0, result.output
    assert "--token-file" in result.output


def test_unknown_command_is_still_an_error() -> None:
    result = CliRunner().invoke(main, ["no-such-command"])
    assert result.exit_code == 2
    assert "No such command" in result.output
