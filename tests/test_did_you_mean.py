"""A misspelt backend name or option field names the closest valid one (and the valid fields).

The old message stays a prefix, so whatever matched it still does; the suggestion follows it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from click.testing import CliRunner

from hicache_storage import ConfigError, UnknownBackendError, create_backend
from hicache_storage.cli import main
from hicache_storage.config import load_config
from hicache_storage.registry import get_spec, registered_backends


def test_an_unknown_backend_names_the_closest_one() -> None:
    known = ", ".join(registered_backends())
    with pytest.raises(UnknownBackendError) as caught:
        get_spec("redsi")
    message = str(caught.value)
    assert message.startswith(
        f"no backend named 'redsi' is registered (registered: {known}); install the package "
        "that provides it or check the spelling"
    )
    assert "did you mean 'redis'?" in message


def test_an_unknown_backend_far_from_every_name_suggests_none() -> None:
    with pytest.raises(UnknownBackendError) as caught:
        get_spec("zzzzzzzzzz")
    assert "did you mean" not in str(caught.value)


def test_hicache_check_of_a_misspelt_backend_names_the_closest_one() -> None:
    result = CliRunner().invoke(main, ["check", "redsi"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: no backend named 'redsi'")
    assert "did you mean 'redis'?" in result.stderr


def test_an_unknown_option_names_the_closest_field_and_lists_them() -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("file", {"rot": "/tmp/x"})
    message = str(caught.value)
    assert message.startswith("invalid file backend options: Object contains unknown field `rot`")
    assert "did you mean `root`?" in message
    assert re.search(r"valid fields: root, .*\bmax_bytes\b", message)


def test_an_unknown_option_far_from_every_field_still_lists_them() -> None:
    with pytest.raises(ConfigError) as caught:
        create_backend("file", {"zzzzzzzz": 1})
    message = str(caught.value)
    assert "did you mean" not in message
    assert "valid fields: root, " in message


def test_hicache_check_of_a_misspelt_option_names_the_closest_field() -> None:
    result = CliRunner().invoke(
        main, ["check", "file", "--config", '{"rot": "/tmp/x"}'], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2
    assert "unknown field `rot`; did you mean `root`? valid fields: root, " in result.stderr


@pytest.mark.parametrize(
    ("data", "prefix", "guess", "fields"),
    [
        ({"bakend": "file"}, "unknown field `bakend`", "backend", "backend, options"),
        (
            {"layers": {"faults": {"sed": 1}}},
            "unknown field `sed` - at `$.layers.faults`",
            "seed",
            "seed, default, ops",
        ),
        (
            {"layers": {"faults": {"ops": {"get": {"delay": 0.1}}}}},
            "unknown field `delay` - at `$.layers.faults.ops[...]`",
            "delay_s",
            "failure_rate, delay_s",
        ),
        (
            {"deployment": {"unified": {"head_grop": 1}}},
            "unknown field `head_grop` - at `$.deployment.unified`",
            "head_group",
            "dtype, ",
        ),
    ],
    ids=["top", "nested", "dict-value", "optional-nested"],
)
def test_an_unknown_config_field_names_the_closest_one_where_it_is(
    data: dict[str, Any], prefix: str, guess: str, fields: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(data, env={})
    message = str(caught.value)
    assert message.startswith(f"invalid hicache config: Object contains {prefix}; ")
    assert f"did you mean `{guess}`? valid fields: {fields}" in message


@pytest.mark.parametrize(
    ("backend", "url"),
    [("redis", "hicache check redis://127.0.0.1:6379/0"), ("s3", "hicache check s3://BUCKET/")],
)
def test_a_backend_checked_without_options_is_told_how_to_give_them(backend: str, url: str) -> None:
    result = CliRunner().invoke(main, ["check", backend], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    first, hint = result.output.splitlines()[:2]
    assert first.startswith(f"error: cannot open the {backend} backend: invalid {backend} backend")
    assert f"pass --config JSON|@FILE (`hicache backends {backend}` lists them)" in hint
    assert url in hint


def test_a_backend_with_no_url_scheme_is_pointed_at_its_options() -> None:
    result = CliRunner().invoke(main, ["check", "mooncake"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "`hicache backends mooncake` lists them" in result.output
    assert "a URL" not in result.output


def test_options_that_were_given_get_no_hint() -> None:
    config = '{"url": "http://127.0.0.1:1"}'
    result = CliRunner().invoke(main, ["check", "redis", "--config", config])
    assert result.exit_code == 2
    assert "redis:// or rediss://" in result.output
    assert "no options were given" not in result.output
