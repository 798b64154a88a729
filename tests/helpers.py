"""Helpers shared by the project's tests."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hicache_storage.conformance.report import Report
from hicache_storage.hostpool import HostKVPool, MHAHostPool, MLAHostPool
from hicache_storage.registry import origin_of, registered_backends

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]

FEW_CHECKS = "-k 'TestRoundTrip and get_matches or TestPersistence or TestMediumFaults'"
"""``PYTEST_ADDOPTS`` for a suite run that tests the command around it, not a backend: a few
checks of each outcome (on memory round trips pass, TestPersistence and TestMediumFaults skip), so
the run takes seconds. Each built-in backend's whole-suite run is its own test."""


def make_pool(kind: str, layout: str, pages: int = 8, page_size: int = 4) -> HostKVPool:
    if kind == "mha":
        return MHAHostPool(
            size=pages * page_size,
            page_size=page_size,
            layer_num=3,
            head_num=2,
            head_dim=8,
            dtype=torch.bfloat16,
            layout=layout,
            pin_memory=False,
        )
    return MLAHostPool(
        size=pages * page_size,
        page_size=page_size,
        layer_num=3,
        kv_cache_dim=24,
        dtype=torch.bfloat16,
        layout=layout,
        pin_memory=False,
    )


def pool_bytes(pool: HostKVPool) -> torch.Tensor:
    """Every byte of ``pool``'s buffer, flat (for sentinel checks)."""
    return pool.kv_buffer.view(-1).view(torch.uint8)


def page_indices(pool: HostKVPool, pages: Iterable[int]) -> list[int]:
    """Host indices of whole ``pages`` of ``pool``, in order."""
    size = pool.page_size
    return [t for p in pages for t in range(p * size, (p + 1) * size)]


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """Return the seconds ``call`` took and what it returned."""
    start = time.monotonic()
    result = call()
    return time.monotonic() - start, result


CAPABILITY_SKIP = re.compile(r"backend does not claim capability '(\w+)'")


INTEGRITY_SKIP = re.compile(r"no plugin corrupts stored bytes of backend '[\w-]+' .*")
PAUSE_SKIP = "the server control has no pause()/resume()"
OTHER_SKIPS = (
    re.compile(r"backend '[\w-]+' declares no namespace_option"),
    re.compile(r"the options under test carry no secret"),
    re.compile(r"this medium raises no '\w+' faults.*"),
    re.compile(r"an? \d+-byte value exceeds max_value_size or half the capacity"),
    re.compile(r"backend stores foreign names: keys carry no format tag, .*"),
    re.compile(r"backend stores foreign names: pages carry no verify record .*"),
)
NO_MEDIUM_HOOK = "backend has no medium fault hook (hicache_storage.kit.MediumFaults)"


def assert_conforms(
    report: Report,
    *,
    server_faults: bool = False,
    integrity: bool = False,
    medium_faults: bool = False,
) -> None:
    """Assert a suite report: nothing failed, and every skip is an unclaimed capability.

    With ``server_faults`` the server-fault checks (stop and pause) must have run and passed;
    without it they must have been skipped for want of a server control. With ``integrity`` the
    corruption checks must have run and passed; without it they must have been skipped for want
    of a corruption hook. With ``medium_faults`` the medium-fault checks must have run (the
    backend holds a ``MediumFaults``); without it they must have been skipped for want of one.
    """
    assert report.totals["failed"] == 0 and report.totals["error"] == 0, report.failures()
    assert report.totals["total"] == len(report.checks) > 100
    claimed = set(report.capabilities)
    # The checks that need a server control (TestNothingAfterReturn pauses it too).
    server_checks = ("TestServerFaults::", "TestNothingAfterReturn::")
    faults = [check for check in report.checks if check.id.startswith(server_checks)]
    corruption = [check for check in report.checks if check.id.startswith("TestIntegrity::")]
    medium = [check for check in report.checks if check.id.startswith("TestMediumFaults::")]
    assert faults and corruption and medium
    assert medium_faults == any(check.outcome == "passed" for check in medium), (
        "the medium-fault checks " + ("did not run" if medium_faults else "ran unexpectedly")
    )
    for check in report.checks:
        unclaimed = [name for name in check.requires if name not in claimed]
        if check.outcome == "skipped":
            reason = check.skip_reason or ""
            match = CAPABILITY_SKIP.fullmatch(reason)
            if match:
                assert match.group(1) in unclaimed, (check.id, reason)
            elif check in corruption:
                assert not integrity and INTEGRITY_SKIP.fullmatch(reason), (check.id, reason)
            elif any(pattern.fullmatch(reason) for pattern in OTHER_SKIPS):
                pass
            elif check in medium:
                assert not medium_faults and reason == NO_MEDIUM_HOOK, (check.id, reason)
            else:
                assert not server_faults and check in faults, (check.id, reason)
                assert reason == (
                    f"no server control for backend {report.backend} "
                    "(provide the hicache_conformance_server hook)"
                )
        else:
            assert check.outcome == "passed", check
            assert not unclaimed, f"{check.id} ran although {unclaimed} is not claimed"


def passing_suite(
    name: str, config: Any, report_dir: Path, extra_args: Iterable[str] = ()
) -> Report:
    """Run the suite on backend ``name``; assert it passed, naming each failed check and why."""
    from hicache_storage.conformance.report import load_report, run_suite

    status = run_suite(name, config, report_dir, list(extra_args))
    report = load_report(report_dir)
    failed = [f"{c.id}: {(c.message or '')[:2000]}" for c in report.failures()]
    assert not failed, f"{len(failed)} checks failed:\n" + "\n".join(failed)
    assert status == 0, f"the suite exited {status} with no failed check"
    return report


def assert_builtin_passes(
    tmp_path: Path, name: str, options: dict[str, object] | None, claims_bounded: bool
) -> None:
    """Run the suite on a built-in backend; assert its report, its skips and its claims."""
    config = None if options is None else {"root": str(tmp_path / "store"), **options}
    report_dir = tmp_path / "report"
    report = passing_suite(name, config, report_dir)
    assert report.backend == name and report.version
    assert ("bounded" in report.capabilities) is claims_bounded
    assert (report_dir / "report.md").read_text().startswith(f"# Conformance report: `{name}`")
    bare = (options or {}).get("naming") == "sglang_file_compat"  # no integrity record
    assert_conforms(report, integrity=name == "file" and not bare, medium_faults=name == "file")
    skipped = {c.id for c in report.checks if c.outcome == "skipped"}
    bounded = {c.id for c in report.checks if "bounded" in c.requires}
    assert bounded and (bounded <= skipped) is not claims_bounded


def builtin_backends() -> list[str]:
    """The backends this distribution registers, sorted; a third-party plugin tests its own."""
    return sorted(
        name for name in registered_backends() if (origin := origin_of(name)) and origin.builtin
    )


@contextlib.contextmanager
def tmpfs(mount: Path, size: str = "1m") -> Iterator[Path]:
    """Mount a real tmpfs of ``size`` at ``mount`` (root only, as CI runs): a disk that fills.

    Writes past it fail with ENOSPC; ``mount -o remount,ro`` makes it fail with EROFS.
    """
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
