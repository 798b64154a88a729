"""The pytest plugin (``pytest11`` entry point ``hicache_storage``) that runs the suite.

``pytest --hicache-backend file --hicache-config '{"root": "/tmp/kv"}'`` collects the conformance
suite (and nothing else, unless test paths are given) against that backend. Options:

--hicache-backend NAME   the registered backend under test; provides ``hicache_factory``.
--hicache-config SOURCE  its options: JSON or ``@path``.
--hicache-report DIR     write ``DIR/report.json`` and ``DIR/report.md``.
--hicache-profile NAME   hypothesis profile of the model-based check: ``ci`` or ``nightly``.
--hicache-progress FILE  append one JSON line per collected, started and finished check
                         (what ``hicache check`` draws its progress bar from).
--hicache-engine         also collect the engine check
                         (:mod:`hicache_storage.conformance.engine`): a tiny model served
                         through the backend, one ``TestEngine`` item per case.

A test module of the author's own gets the engine check with
``from hicache_storage.conformance.engine import TestEngine`` beside its ``hicache_factory``
fixture: this plugin parametrizes it (``hicache_engine_case``) and runs each case
(``hicache_engine_check``), with the server control a plugin provides for ``server_stop``.

Importing this module is cheap: backends, torch and the suite load only when they are used.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hicache_storage.conformance.engine import EngineCheck
    from hicache_storage.conformance.factory import BackendFactory
    from hicache_storage.conformance.report import CheckResult, Outcome, ProgressEvent

__all__ = [
    "engine_path",
    "hicache_engine_check",
    "hicache_factory",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_itemcollected",
    "suite_path",
]

ENGINE_CASE = "hicache_engine_case"
"""The argument each ``TestEngine`` item is parametrized with: the name of its case."""

REQUIRES_MARKER = "hicache_requires"


def _module_path(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:  # pragma: no cover - the package is broken
        raise RuntimeError(f"cannot locate {name}")
    return spec.origin


def suite_path() -> str:
    """Return the file path of the suite module (found without importing it)."""
    return _module_path("hicache_storage.conformance.suite")


def engine_path() -> str:
    """Return the file path of the engine check's module (found without importing it)."""
    return _module_path("hicache_storage.conformance.engine")


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the ``hicache`` option group."""
    group = parser.getgroup("hicache", "hicache-storage conformance suite")
    group.addoption(
        "--hicache-backend",
        dest="hicache_backend",
        default=None,
        metavar="NAME",
        help="run the conformance suite against this registered backend",
    )
    group.addoption(
        "--hicache-config",
        dest="hicache_config",
        default=None,
        metavar="JSON|@file",
        help="options of the backend under test, as JSON or @path to a JSON file",
    )
    group.addoption(
        "--hicache-report",
        dest="hicache_report",
        default=None,
        metavar="DIR",
        help="write report.json and report.md into DIR",
    )
    group.addoption(
        "--hicache-profile",
        dest="hicache_profile",
        default="ci",
        choices=("ci", "nightly"),
        help="hypothesis profile of the model-based check (default: ci)",
    )
    group.addoption(
        "--hicache-progress",
        dest="hicache_progress",
        default=None,
        metavar="FILE",
        help="append one JSON line per collected, started and finished check to FILE",
    )
    group.addoption(
        "--hicache-engine",
        dest="hicache_engine",
        action="store_true",
        default=False,
        help="also run the engine check: a tiny model served through the backend (TestEngine)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker; with ``--hicache-backend`` and no paths, collect only the suite."""
    config.addinivalue_line(
        "markers",
        f"{REQUIRES_MARKER}(*capabilities): skip unless the backend under test claims them",
    )
    named_paths = config.args_source == pytest.Config.ArgsSource.ARGS
    if config.getoption("hicache_backend", default=None) and not named_paths:
        config.args[:] = [suite_path()]
        if config.getoption("hicache_engine", default=False):
            config.args.append(engine_path())
    if config.getoption("hicache_report", default=None):
        config.pluginmanager.register(_Recorder(config), "hicache-report-recorder")
    progress = config.getoption("hicache_progress", default=None)
    if progress:
        config.pluginmanager.register(_Progress(str(progress)), "hicache-progress")


@pytest.fixture(scope="session")
def hicache_factory(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> BackendFactory:
    """Return the backend under test, from ``--hicache-backend`` and ``--hicache-config``.

    Without ``--hicache-config``, a backend whose options require a ``root`` or a ``path`` gets
    one under the session's temporary directory, as ``hicache check`` gives it.
    """
    name = pytestconfig.getoption("hicache_backend", default=None)
    if not name:
        pytest.fail(
            "no backend under test: pass --hicache-backend NAME or define a hicache_factory "
            "fixture returning a BackendFactory",
            pytrace=False,
        )
    return _factory(pytestconfig, str(name), lambda: str(tmp_path_factory.mktemp("hicache")))


def _factory(config: pytest.Config, name: str, scratch: Callable[[], str]) -> BackendFactory:
    """Build the recipe of ``name`` from ``--hicache-config``, else with scratch places."""
    from hicache_storage.conformance.factory import BackendFactory
    from hicache_storage.registry import get_spec

    source = config.getoption("hicache_config", default=None)
    if source is None and get_spec(name).scratch_options(""):
        return BackendFactory(name, get_spec(name).scratch_options(scratch()))
    return BackendFactory.from_source(name, source)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Make one item per engine case of every test that asks for ``hicache_engine_case``."""
    if ENGINE_CASE not in metafunc.fixturenames:
        return
    from hicache_storage.conformance.engine import DEFAULT_CASES, POLICIES, case_names

    metafunc.parametrize(ENGINE_CASE, case_names(POLICIES, DEFAULT_CASES))


@pytest.fixture
def hicache_engine_check(hicache_factory: BackendFactory, hicache_engine_case: str) -> EngineCheck:
    """Run one case of the engine check against the backend under test; skip if it skipped.

    ``server_stop`` gets the server control a plugin provides for the backend (and skips
    without one); the server is started again afterwards whatever happened.
    """
    from hicache_storage.conformance.engine import check_engine
    from hicache_storage.conformance.server import find_server_control

    control = None
    if hicache_engine_case.startswith("server_"):
        control = find_server_control(hicache_factory.name, hicache_factory.options)
    try:
        report = check_engine(hicache_factory, cases=[hicache_engine_case], server_control=control)
    finally:
        if control is not None:
            control.start()
    check = report.checks[0]
    if check.outcome == "skipped":
        pytest.skip(check.message or "skipped")
    return check


def pytest_collection_finish(session: pytest.Session) -> None:
    """With ``--hicache-backend``, refuse once a backend that claims what it does not implement.

    Every check would otherwise fail with the same message (the cleanup after each uses the
    claimed method); a backend that cannot be built is left to the checks, which say why.
    """
    name = session.config.getoption("hicache_backend", default=None)
    if not name or not session.items:
        return
    from hicache_storage.conformance.fixtures import unbacked_claims_of
    from hicache_storage.errors import HiCacheError

    try:
        with tempfile.TemporaryDirectory(prefix="hicache-claims-") as scratch:
            unbacked = unbacked_claims_of(_factory(session.config, str(name), lambda: scratch))
    except HiCacheError:
        return
    if unbacked:
        raise pytest.UsageError("; ".join(unbacked) + ": drop the claim or implement the method")


def pytest_itemcollected(item: pytest.Item) -> None:
    """Remember the capabilities each check requires (for the report)."""
    required: list[str] = []
    for marker in item.iter_markers(REQUIRES_MARKER):
        required.extend(str(name) for name in marker.args)
    item.stash[_REQUIRES] = required


_REQUIRES = pytest.StashKey[list[str]]()


def _check_id(nodeid: str) -> str:
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        message = str(longrepr[2])
    else:
        message = str(longrepr)
    return message.removeprefix("Skipped: ")


def _failed_statement(report: pytest.TestReport) -> str | None:
    """Return the source line pytest marks with ``>`` in the innermost frame, if any."""
    traceback = getattr(report.longrepr, "reprtraceback", None)
    entries = getattr(traceback, "reprentries", None)
    if not entries:
        return None
    lines = getattr(entries[-1], "lines", None) or []
    marked = [str(line)[1:].strip() for line in lines if str(line).startswith(">")]
    return marked[-1] if marked else None


def _failure(report: pytest.TestReport) -> str:
    """Return what failed, in one line (see :func:`~.report.failure_message`)."""
    from hicache_storage.conformance.report import failure_message

    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(report.longrepr)
    return failure_message(str(text), _failed_statement(report))


def _outcome(report: pytest.TestReport, current: Outcome) -> Outcome:
    """Fold one phase's report into the check's outcome so far (a failed setup is an error)."""
    if report.when == "call":
        if report.skipped:
            return "skipped"
        return "failed" if report.failed else current
    if report.skipped and report.when == "setup":
        return "skipped"
    if report.failed and current not in ("failed", "error"):
        return "error"
    return current


class _Recorder:
    """Collects one row per check and writes the report when the session ends."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rows: dict[str, CheckResult] = {}
        self.requires: dict[str, list[str]] = {}
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.requires[item.nodeid] = item.stash.get(_REQUIRES, [])

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from hicache_storage.conformance.report import CheckResult

        row = self.rows.get(report.nodeid)
        if row is None:
            row = self.rows[report.nodeid] = CheckResult(
                id=_check_id(report.nodeid),
                outcome="passed",
                requires=list(self.requires.get(report.nodeid, [])),
            )
        row.duration_s += report.duration
        outcome = _outcome(report, row.outcome)
        if outcome != row.outcome:
            row.outcome = outcome
            if outcome == "skipped":
                row.skip_reason = _skip_reason(report)
            else:
                row.message = _failure(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from hicache_storage.conformance.report import Report, write_report

        name = self.config.getoption("hicache_backend", default=None)
        report = Report(
            backend=str(name or "custom"),
            version="unknown",
            duration_s=time.monotonic() - self.started,
            exit_status=int(exitstatus),
            checks=list(self.rows.values()),
        )
        if name:
            _describe(report, str(name), self.config.getoption("hicache_config"))
        write_report(report, self.config.getoption("hicache_report"))


class _Progress:
    """Appends one :data:`~.report.ProgressEvent` per JSON line to a file as the run goes."""

    def __init__(self, path: str) -> None:
        self.stream: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115 - closed at unconfigure
        self.outcomes: dict[str, Outcome] = {}

    def _write(self, event: ProgressEvent) -> None:
        import msgspec

        self.stream.write(msgspec.json.encode(event) + b"\n")

    @pytest.hookimpl
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from hicache_storage.conformance.report import Collected

        self._write(Collected(total=len(session.items)))

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        from hicache_storage.conformance.report import Started

        self._write(Started(id=_check_id(nodeid)))

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.outcomes[report.nodeid] = _outcome(report, self.outcomes.get(report.nodeid, "passed"))

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        from hicache_storage.conformance.report import Finished

        outcome = self.outcomes.pop(nodeid, "passed")
        self._write(Finished(id=_check_id(nodeid), outcome=outcome))

    @pytest.hookimpl
    def pytest_unconfigure(self) -> None:
        self.stream.close()


def _describe(report: Any, name: str, source: Any) -> None:
    """Fill in the backend's version, options and claimed capabilities."""
    from hicache_storage.conformance.factory import BackendFactory
    from hicache_storage.conformance.fixtures import capabilities_of

    try:
        factory = BackendFactory.from_source(name, source)
        report.options = dict(factory.options)
        report.version = factory.version()
        caps = capabilities_of(factory)
    except Exception as exc:  # noqa: BLE001 - a broken backend still gets a report
        report.capabilities_error = f"{type(exc).__name__}: {exc}"
        return
    report.capabilities = caps.claimed()
    report.max_value_size = caps.max_value_size
