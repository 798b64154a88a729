"""``hicache sglang-args`` and ``vllm-args``: the flags read back as the integrations read them.

SGLang's side is read by the adapter's own :func:`~hicache_storage.integrations.sglang.config_from`
(SGLang's ``HiCacheStorageConfig`` built directly, no server); vLLM's by the tier's own
:func:`~hicache_storage.integrations.vllm.tier_settings`, which needs no vLLM, and the whole
``--kv-transfer-config`` is compared with the one the vLLM tests serve with
(``harness.kv_transfer_config``).
"""

from __future__ import annotations

import json
import os
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hicache_storage.cli import main
from hicache_storage.config import ENV_PREFIX, RESERVED_ENV
from hicache_storage.integrations.vllm import tier_settings

SECRET = "s3cret-pw"
EXTRA_FLAG = "--hicache-storage-backend-extra-config"


@pytest.fixture(autouse=True)
def _no_hicache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The integrations let ``HICACHE_*`` variables override the config: start without any."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX) and name not in RESERVED_ENV:
            monkeypatch.delenv(name)


def invoke(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin)


def sglang_extra(line: str) -> dict[str, Any]:
    words = shlex.split(line)
    assert words[:3] == ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic"]
    assert words[3] == EXTRA_FLAG and len(words) == 5, words
    extra: dict[str, Any] = json.loads(words[4])
    return extra


def vllm_transfer(line: str) -> dict[str, Any]:
    words = shlex.split(line)
    assert words[0] == "--kv-transfer-config" and len(words) == 2, words
    transfer: dict[str, Any] = json.loads(words[1])
    return transfer


def sglang_config(extra: dict[str, Any]) -> Any:
    """Our config as the SGLang adapter reads it from ``extra`` for a single rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns at import that some kernels need a GPU
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        from hicache_storage.integrations.sglang import config_from
    storage_config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="org/model",
        extra_config=extra,
    )
    return config_from(storage_config)


def tier_entry(transfer: dict[str, Any]) -> dict[str, Any]:
    """The ``secondary_tiers`` entry as the tier sees it: vLLM takes its own keys out first."""
    (entry,) = transfer["kv_connector_extra_config"]["secondary_tiers"]
    assert (entry["type"], entry["module_path"]) == (
        "HiCacheTier",
        "hicache_storage.integrations.vllm",
    )
    return {key: value for key, value in entry.items() if key not in ("type", "module_path")}


# -- the flags read back --------------------------------------------------------------------------

QUOTED_ROOT = "/tmp/it's a dir/kv"  # a quote and spaces: shlex quoting must keep them


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("memory", {}),
        ("file", {"root": QUOTED_ROOT, "naming": "sglang_file_compat"}),
        ("redis", {"url": "redis://10.0.0.5:6379/0", "prefix": "qwen3"}),
    ],
    ids=["memory", "file", "redis"],
)
def test_sglang_flags_read_back_by_the_adapter(backend: str, options: dict[str, Any]) -> None:
    result = invoke("sglang-args", backend, "--config", json.dumps(options))
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    extra = sglang_extra(result.stdout)
    assert {key: extra[key] for key in ("backend_name", "module_path", "class_name")} == {
        "backend_name": "hicache",
        "module_path": "hicache_storage.integrations.sglang",
        "class_name": "SGLangStorage",
    }
    assert extra["interface_v1"] == 1
    config = sglang_config(extra)
    assert config.backend == backend
    assert config.options == options


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("memory", {}),
        ("file", {"root": QUOTED_ROOT}),
        ("redis", {"url": "redis://10.0.0.5:6379/0"}),
    ],
    ids=["memory", "file", "redis"],
)
def test_vllm_flags_read_back_by_the_tier(backend: str, options: dict[str, Any]) -> None:
    result = invoke("vllm-args", backend, "--config", json.dumps(options))
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    transfer = vllm_transfer(result.stdout)
    settings = tier_settings(tier_entry(transfer))
    assert settings.hicache.backend == backend
    assert settings.hicache.options == options
    extra = transfer["kv_connector_extra_config"]
    assert (transfer["kv_connector"], transfer["kv_role"]) == ("OffloadingConnector", "kv_both")
    assert (extra["spec_name"], extra["cpu_bytes_to_use"]) == ("TieringOffloadingSpec", 8 * 10**9)


@pytest.mark.parametrize("cpu_worker", [False, True], ids=["gpu", "cpu-worker"])
def test_vllm_config_is_the_one_the_vllm_tests_serve_with(cpu_worker: bool) -> None:
    from hicache_storage.integrations.vllm import harness

    args = ["vllm-args", "file", "--config", '{"root": "/kv"}', "--cpu-bytes", "2GiB", "--json"]
    result = invoke(*args, *(["--cpu-worker"] if cpu_worker else []))
    assert result.exit_code == 0, result.output
    tier = {"backend": "file", "options": {"root": "/kv"}}
    expected = harness.kv_transfer_config(tier, cpu_bytes=2 << 30, cpu_worker=cpu_worker)
    assert json.loads(result.stdout) == expected


def test_json_prints_only_the_extra_config() -> None:
    result = invoke("sglang-args", "file", "--config", '{"root": "/kv"}', "--json")
    assert result.exit_code == 0, result.output
    extra = json.loads(result.stdout)
    line = invoke("sglang-args", "file", "--config", '{"root": "/kv"}').stdout
    assert extra == sglang_extra(line)
    assert sglang_config(extra).options == {"root": "/kv"}


def test_config_from_a_file_or_standard_input(tmp_path: Path) -> None:
    path = tmp_path / "opts.json"
    path.write_text('{"root": "/from-file"}')
    for source in (f"@{path}", str(path)):
        result = invoke("sglang-args", "file", "--config", source)
        assert result.exit_code == 0, result.output
        assert sglang_extra(result.stdout)["options"] == {"root": "/from-file"}
    result = invoke("vllm-args", "file", "--config", "-", stdin='{"root": "/from-stdin"}')
    assert result.exit_code == 0, result.output
    assert tier_entry(vllm_transfer(result.stdout))["options"] == {"root": "/from-stdin"}


# -- mistakes exit 2 before anything is printed ---------------------------------------------------


@pytest.mark.parametrize("command", ["sglang-args", "vllm-args"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["redsi"], "no backend named 'redsi' is registered"),
        (["file", "--config", '{"root": "/kv", "rot": 1}'], "unknown field `rot`"),
        (["file", "--config", '{"root": 5}'], "Expected `str`, got `int`"),
        (["file"], "missing required field `root`"),
        (["memory", "--config", "{"], "not valid JSON"),
        (["file", "--config", "@/no/such/file.json"], "cannot read config file"),
    ],
    ids=["backend-typo", "unknown-option", "wrong-type", "missing-option", "bad-json", "no-file"],
)
def test_mistakes_exit_2_with_a_message(command: str, args: list[str], message: str) -> None:
    result = invoke(command, *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert message in result.stderr


def test_bad_cpu_bytes_exits_2() -> None:
    result = invoke("vllm-args", "memory", "--cpu-bytes", "lots")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "--cpu-bytes 'lots'" in result.stderr


# -- secrets ---------------------------------------------------------------------------------------

REDIS_SECRETS = {"url": f"redis://user:{SECRET}@10.0.0.5:6379/0", "password": SECRET + "2"}


@pytest.mark.parametrize("as_json", [False, True], ids=["flags", "json"])
@pytest.mark.parametrize("command", ["sglang-args", "vllm-args"])
def test_secrets_are_not_printed_in_clear(command: str, as_json: bool) -> None:
    args = [command, "redis", "--config", json.dumps(REDIS_SECRETS)]
    result = invoke(*args, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    assert SECRET not in result.stdout
    assert SECRET not in result.stderr
    assert "redis://user:***@10.0.0.5:6379/0" in result.stdout
    assert '"password": "***"' in result.stdout
    assert "HICACHE_OPTIONS__URL" in result.stderr
    assert "HICACHE_OPTIONS__PASSWORD" in result.stderr
    assert "--show-secrets" in result.stderr


def test_the_variables_named_replace_the_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    """What stderr advises works: the variables override the masked values in both engines."""
    result = invoke("sglang-args", "redis", "--config", json.dumps(REDIS_SECRETS))
    extra = sglang_extra(result.stdout)
    line = invoke("vllm-args", "redis", "--config", json.dumps(REDIS_SECRETS)).stdout
    entry = tier_entry(vllm_transfer(line))
    monkeypatch.setenv("HICACHE_OPTIONS__URL", REDIS_SECRETS["url"])
    monkeypatch.setenv("HICACHE_OPTIONS__PASSWORD", REDIS_SECRETS["password"])
    assert sglang_config(extra).options == REDIS_SECRETS
    assert tier_settings(entry).hicache.options == REDIS_SECRETS


def test_a_nested_secret_names_a_variable_it_can_be_set_with() -> None:
    options = {"url": "s3://bucket/kv", "storage_options": {"token": SECRET, "AWS_Secret": SECRET}}
    result = invoke("sglang-args", "fsspec", "--config", json.dumps(options))
    assert result.exit_code == 0, result.output
    assert SECRET not in result.stdout + result.stderr
    assert "HICACHE_OPTIONS__STORAGE_OPTIONS__TOKEN" in result.stderr
    # A mixed-case name cannot be spelled in a variable: the enclosing option is set as JSON.
    assert "set HICACHE_OPTIONS__STORAGE_OPTIONS to the JSON of" in result.stderr


@pytest.mark.parametrize("command", ["sglang-args", "vllm-args"])
def test_show_secrets_prints_them(command: str) -> None:
    args = [command, "redis", "--config", json.dumps(REDIS_SECRETS), "--show-secrets"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    if command == "sglang-args":
        assert sglang_config(sglang_extra(result.stdout)).options == REDIS_SECRETS
    else:
        assert tier_settings(tier_entry(vllm_transfer(result.stdout))).hicache.options == (
            REDIS_SECRETS
        )
