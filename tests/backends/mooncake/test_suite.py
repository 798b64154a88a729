"""The Mooncake backend passes the whole conformance suite against a real master.

Runs last in this directory: its fault checks stop and restart the session's master.
"""

from __future__ import annotations

from pathlib import Path

from hicache_storage.conformance.provision import LocalService
from hicache_storage.conformance.report import load_report, run_suite

from ...helpers import assert_conforms


def test_mooncake_passes_suite_with_server_faults(
    mooncake_store: LocalService, tmp_path: Path
) -> None:
    config = {
        "master": mooncake_store.options["master"],
        "global_segment_size": 0,
        "local_hostname": "127.0.0.1",
        "prefix": "conformance/",
    }
    report_dir = tmp_path / "report"
    run_suite("mooncake", config, report_dir)
    report = load_report(report_dir)
    assert_conforms(report, server_faults=True)
    claimed = set(report.capabilities)
    assert {"persistent", "shared", "native_zero_copy", "delete", "crash_safe_writes"} <= claimed
    outcomes = {check.id: check.outcome for check in report.checks}
    handoff = "TestMultiProcess::test_process_writes_exits_other_process_reads"
    assert outcomes[handoff] == "passed"
    assert outcomes["TestServerFaults::test_server_restart_recovers"] == "passed"
