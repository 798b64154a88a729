"""What ``hicache`` users see: one-line refusals, honest summaries, readable tables, progress."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import tempfile
import termios
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result
from rich.console import Console

from hicache_storage import (
    BackendSpec,
    ConfigError,
    Deployment,
    hookimpl,
    register_plugin,
    registered_backends,
    unregister_plugin,
)
from hicache_storage.backends.memory import MemoryBackend
from hicache_storage.cli import main
from hicache_storage.cli.check import render
from hicache_storage.conformance.report import (
    CheckResult,
    Collected,
    Finished,
    ProgressEvent,
    Report,
    Started,
    failure_message,
    load_report,
    run_suite,
    summarize,
)

from .helpers import FEW_CHECKS
from .test_registry import install_broken_plugin

ROOT = Path(__file__).resolve().parents[1]
SECRET = "tok-0123456789abcdef"
SMALL = ["--page-size", "64KiB", "--batch-size", "4", "--batches", "2", "--repeat", "1"]


def invoke(*args: str, columns: int = 80) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": str(columns)})


def _hicache(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from hicache_storage.cli import main; main()", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@pytest.fixture
def example_installed() -> None:
    if importlib.util.find_spec("hicache_example_sqlite") is None:
        pytest.fail("the example package is not installed (scripts/test.sh installs it)")


# 1. A backend that refuses its options at construction: one line, exit 2, secrets masked.


class RefusingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    token: str = ""


class RefusingBackend(MemoryBackend):
    """Refuses every token, naming it (a careless third-party message)."""

    def __init__(self, config: RefusingConfig, deployment: Deployment | None = None) -> None:
        raise ConfigError(f"the server refused token {config.token!r}")


class _RefusingPlugin:
    @hookimpl
    def hicache_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="refusing",
                factory=f"{__name__}:RefusingBackend",
                config=f"{__name__}:RefusingConfig",
            )
        ]


@pytest.fixture
def refusing() -> Iterator[None]:
    plugin = _RefusingPlugin()
    register_plugin(plugin)
    yield
    unregister_plugin(plugin)


@pytest.mark.usefixtures("refusing")
def test_check_backend_refusing_its_options_exits_2_in_one_masked_line() -> None:
    result = invoke("check", "refusing", "--config", json.dumps({"token": SECRET}))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "error: cannot open the refusing backend: the server refused token '***'"
    ]
    assert SECRET not in result.output
    assert result.stdout == ""


def test_check_file_backend_that_cannot_open_its_root_exits_2(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    result = invoke("check", "file", "--config", json.dumps({"root": str(not_a_directory)}))
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: cannot open the file backend: ") and str(not_a_directory) in line


# 2. The summary counts errored checks apart from failed ones.


def _report(*outcomes: str) -> Report:
    checks = [CheckResult(id=f"TestX::test_{i}", outcome=o) for i, o in enumerate(outcomes)]
    totals = {name: outcomes.count(name) for name in ("passed", "failed", "skipped", "error")}
    return Report(backend="x", version="1.0", checks=checks, totals=totals)


def _rendered(report: Report) -> str:
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    return out.getvalue()


def test_check_summary_counts_errored_checks() -> None:
    text = _rendered(_report("passed", "error", "error", "skipped"))
    assert "FAIL x 1.0: 1 passed, 0 failed, 2 errored, 1 skipped in" in text


def test_check_summary_mentions_errored_only_when_some_errored() -> None:
    assert summarize({"passed": 3, "failed": 1, "skipped": 2, "error": 0}) == (
        "3 passed, 1 failed, 2 skipped"
    )
    assert "PASS x 1.0: 2 passed, 0 failed, 0 skipped" in _rendered(_report("passed", "passed"))


# 3. bench gives a backend that needs a root or path a temporary one, like check.


@pytest.mark.usefixtures("example_installed")
def test_bench_third_party_backend_needing_a_path_runs_in_a_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = invoke("bench", "example-sqlite", *SMALL, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"] == "example-sqlite" and report["results"][0]["verified"] > 0
    assert list(tmp_path.iterdir()) == []


# 4. and 8. hicache backends: who provides each backend, readable at 80 columns.


@pytest.mark.usefixtures("example_installed")
def test_backends_labels_third_party_by_distribution_and_version() -> None:
    version = importlib.metadata.version("hicache-example-sqlite")
    rows = {row["name"]: row for row in json.loads(invoke("backends", "--json").stdout)}
    assert rows["example-sqlite"]["provider"] == f"hicache-example-sqlite {version}"
    assert rows["example-sqlite"]["install"] == f"hicache-example-sqlite {version}"
    assert (rows["example-sqlite"]["distribution"], rows["example-sqlite"]["version"]) == (
        "hicache-example-sqlite",
        version,
    )
    assert rows["memory"]["provider"] == "built in"
    table = invoke("backends", columns=200).stdout
    row = next(line for line in table.splitlines() if " example-sqlite " in line)
    assert "hicache-example-sqlite" in row and "built in" not in row


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z0-9_]+", text))


def test_backends_fits_80_columns_without_cutting_capabilities() -> None:
    result = invoke("backends", columns=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    claimed = {c for spec in registered_backends().values() for c in spec.capabilities.claimed()}
    assert claimed <= _words(result.stdout)


def test_backends_wide_shows_every_column_uncut() -> None:
    result = invoke("backends", "--wide", columns=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    for spec in registered_backends().values():
        assert spec.description in result.stdout
    assert "max value" in result.stdout and "description" in result.stdout


@pytest.mark.usefixtures("example_installed")
def test_backends_name_shows_everything_about_one_backend() -> None:
    result = invoke("backends", "example-sqlite", columns=80)
    assert result.exit_code == 0, result.output
    version = importlib.metadata.version("hicache-example-sqlite")
    for fact in (
        f"hicache-example-sqlite {version}",
        "hicache_example_sqlite.backend:SqliteBackend",
        "path (required)",
        "timeout_s = 5.0",
        "crash_safe_writes",
        "not claimed",
    ):
        assert fact in result.stdout
    assert "…" not in result.stdout
    detail = json.loads(invoke("backends", "example-sqlite", "--json").stdout)
    assert detail["options"] == ["path (required)", "timeout_s = 5.0"]


def test_backends_unknown_name_exits_2() -> None:
    result = invoke("backends", "no-such-backend")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: no backend named 'no-such-backend'")


# 5. A plugin that fails to import is a warning and a broken row; everything else still works.


@pytest.mark.filterwarnings("always::hicache_storage.registry.PluginLoadWarning")
def test_backends_lists_a_plugin_that_failed_to_import_as_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_broken_plugin(tmp_path, monkeypatch)
    result = invoke("backends", columns=80)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "warning: skipped hicache-storage plugin 'broken-import' (from hicache-test-broken "
        "1.2.3): ImportError: needs libfoo"
    ]
    row = next(line for line in result.stdout.splitlines() if "broken-import" in line)
    assert "broken" in row.replace("broken-import", "")
    assert "broken plugin broken-import: ImportError: needs libfoo" in result.stdout
    assert " memory " in result.stdout
    rows = {row["name"]: row for row in json.loads(invoke("backends", "--json").stdout)}
    assert rows["broken-import"]["error"] == "ImportError: needs libfoo"
    assert rows["broken-import"]["provider"] == "hicache-test-broken 1.2.3"
    assert rows["memory"]["error"] is None


def test_check_memory_passes_beside_a_plugin_that_failed_to_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_broken_plugin(site, monkeypatch)
    env = {"PYTHONPATH": str(site), "PYTEST_ADDOPTS": FEW_CHECKS}
    result = _hicache("check", "memory", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "warning: skipped hicache-storage plugin 'broken-import'" in result.stderr
    assert "PASS memory" in result.stdout
    # Not a terminal: no progress bar in the output.
    assert "checking memory" not in result.stdout + result.stderr


# 6. Every failure row names what failed.


FAILING_CHECKS = """
import traceback

from hicache_storage.errors import BackendIOError


def is_there(key):
    return False


def _thread_errors():
    try:
        raise BackendIOError("disk gone")
    except BackendIOError:
        return [traceback.format_exc()]


def test_bare_assert():
    ok = False
    assert ok


def test_assert_on_a_call():
    assert is_there("k")


def test_thread_traceback_as_message():
    errors = _thread_errors()
    assert not errors, errors[0]


def test_counted_thread_tracebacks():
    errors = _thread_errors()
    assert not errors, f"{len(errors)} calls failed; the first:\\n{errors[0]}"


def test_raises():
    raise BackendIOError("disk gone")
"""


def test_failure_rows_name_what_failed(tmp_path: Path) -> None:
    (tmp_path / "test_failing.py").write_text(FAILING_CHECKS)
    options = ["-q", "-p", "no:cacheprovider", "--hicache-report", str(tmp_path / "report")]
    subprocess.run(
        [sys.executable, "-m", "pytest", *options, "test_failing.py"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    messages = {row.id: row.message for row in load_report(tmp_path / "report").checks}
    assert messages == {
        "test_bare_assert": "assert ok failed (assert False)",
        "test_assert_on_a_call": "assert False (where False = is_there('k'))",
        "test_thread_traceback_as_message": "BackendIOError: disk gone",
        "test_counted_thread_tracebacks": "1 calls failed; the first: BackendIOError: disk gone",
        "test_raises": "BackendIOError: disk gone",
    }


@pytest.mark.parametrize(
    ("text", "statement", "expected"),
    [
        pytest.param(
            "AssertionError: assert (True is False)\n +  where True = exists('k')\n"
            " +    where exists = <ValidationLayer>.exists",
            None,
            "assert (True is False) (where True = exists('k'))",
            id="where",
        ),
        pytest.param(
            'AssertionError: Traceback (most recent call last):\n  File "a.py", line 1\n'
            "    f()\nKeyError: 'a'\n\nDuring handling of the above exception, another exception"
            ' occurred:\n\nTraceback (most recent call last):\n  File "b.py", line 2\n'
            "    g()\nhicache_storage.errors.BackendIOError: disk gone",
            None,
            "BackendIOError: disk gone",
            id="chained-traceback",
        ),
        pytest.param(
            "hypothesis.errors.FlakyStrategyDefinition: Inconsistent data generation!\n\nMore",
            None,
            "FlakyStrategyDefinition: Inconsistent data generation!",
            id="qualified",
        ),
        pytest.param("AssertionError", "assert x == y", "assert x == y", id="bare-error"),
        pytest.param(
            "Failed: Timeout (>8.0s) from pytest-timeout.",
            None,
            "Failed: Timeout (>8.0s) from pytest-timeout.",
            id="timeout",
        ),
    ],
)
def test_failure_message(text: str, statement: str | None, expected: str) -> None:
    assert failure_message(text, statement) == expected


def test_broken_backend_failures_have_meaningful_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    args = ["-p", "tests.broken_backends.plugin", "-k", "TestDelete or TestRoundTrip"]
    with open(tmp_path / "pytest.log", "wb") as log:
        run_suite("broken-zombie", None, tmp_path / "report", args, output=log)
    failures = load_report(tmp_path / "report").failures()
    assert failures
    for row in failures:
        assert row.message and "Traceback" not in row.message
        assert row.message not in ("assert False", "AssertionError"), row


# 7. Progress: the suite reports each check as it finishes; a terminal gets a bar.


def test_run_suite_streams_progress(tmp_path: Path) -> None:
    events: list[ProgressEvent] = []
    with open(tmp_path / "pytest.log", "wb") as log:
        status = run_suite(
            "memory",
            None,
            tmp_path / "report",
            ["-k", "TestRoundTrip"],
            output=log,
            progress=events.append,
        )
    assert status == 0
    report = load_report(tmp_path / "report")
    assert isinstance(events[0], Collected) and events[0].total == len(report.checks) > 0
    finished = [e for e in events if isinstance(e, Finished)]
    started = [e.id for e in events if isinstance(e, Started)]
    assert started == [e.id for e in finished] == [row.id for row in report.checks]
    assert {e.id: e.outcome for e in finished} == {row.id: row.outcome for row in report.checks}


def test_check_on_a_terminal_shows_a_progress_bar(tmp_path: Path) -> None:
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from hicache_storage.cli import main; main()", "check", "memory"],
        cwd=tmp_path,
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env={**env, "TERM": "xterm-256color", "PYTEST_ADDOPTS": FEW_CHECKS},
    )
    os.close(secondary)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(primary, 1 << 16)
        except OSError:  # the terminal closed: the command exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    proc.wait(timeout=300)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    assert re.search(r"checking memory: Test\w+ .* \d+/\d+", screen), screen[-3000:]
    assert "memory 0.1.0:" in screen
