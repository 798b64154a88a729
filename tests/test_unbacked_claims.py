"""A capability claimed without its method is one clear error up front, not a failed row a check.

The suite cleans up after each check with ``delete`` where the backend claims it; a backend that
claims ``delete`` on the base class's refusing method would fail every check with one message.
``hicache check`` refuses it before running (exit 2), ``pytest --hicache-backend`` at collection.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hicache_storage import Capabilities, StorageBackend
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.capabilities import unbacked_claims
from hicache_storage.cli.main import main
from hicache_storage.registry import PLUGINS_ENV

from .env_plugin import install_env_plugin

PLUGIN = """
from hicache_storage import Capabilities, StorageBackend
from hicache_storage.backends.memory.backend import MemoryBackend
from hicache_storage.registry import BackendSpec, hookimpl


class ClaimsDelete(MemoryBackend):
    name = "claims-delete"
    capabilities = Capabilities(delete=True)
    delete = StorageBackend.delete  # the base class's refusal


@hookimpl
def hicache_backends():
    return [
        BackendSpec(
            name="claims-delete",
            factory=f"{__name__}:ClaimsDelete",
            config="hicache_storage.backends.memory.config:MemoryConfig",
            capabilities=ClaimsDelete.capabilities,
        )
    ]
"""


class _NoDelete(StorageBackend):
    name = "no-delete"


def test_a_claim_on_the_base_class_method_is_named() -> None:
    claims = Capabilities(delete=True, persistent=True)
    assert unbacked_claims(_NoDelete, claims) == [
        "_NoDelete claims 'delete' but does not implement delete()"
    ]
    assert unbacked_claims(_NoDelete, Capabilities(persistent=True)) == []
    assert unbacked_claims(MemoryBackend, Capabilities(delete=True)) == []


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    module = install_env_plugin(tmp_path, monkeypatch)
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    return module


def test_check_refuses_the_claim_before_running(plugin_module: str) -> None:
    result = CliRunner().invoke(main, ["check", "claims-delete"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: ClaimsDelete claims 'delete' but does not implement delete(): "
        "drop the claim or implement the method"
    )


def test_the_pytest_plugin_refuses_it_once_at_collection(
    tmp_path: Path, plugin_module: str
) -> None:
    env = {
        **os.environ,
        PLUGINS_ENV: plugin_module,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--hicache-backend",
            "claims-delete",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert out.count("claims 'delete' but does not implement delete()") == 1, out[-3000:]
    assert " passed" not in out and " failed" not in out
