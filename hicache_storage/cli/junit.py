"""JUnit XML for ``hicache check --junit-xml``: one ``testcase`` per check, as CI systems read it.

It is built from the report, not by pytest's ``--junitxml``: the report's messages have the
backend's secrets masked, and its check ids (``Class::test[param]``) give clean class names.
"""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..conformance.engine import EngineReport
    from ..conformance.report import Report

__all__ = ["Case", "engine_cases", "suite_cases", "write_junit"]

# Characters XML 1.0 cannot hold at all; a message quoting raw bytes may carry some.
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class Case(NamedTuple):
    """One testcase: ``classname`` groups it (the check's class), ``name`` names it."""

    classname: str
    name: str
    outcome: str
    duration_s: float
    message: str | None


def suite_cases(report: Report) -> list[Case]:
    """Return the suite's checks as cases: ``TestX::test_y[p]`` is ``test_y[p]`` of ``TestX``."""
    cases = []
    for check in report.checks:
        classname, _, name = check.id.rpartition("::")
        cases.append(
            Case(
                classname or "conformance",
                name,
                check.outcome,
                check.duration_s,
                check.skip_reason if check.outcome == "skipped" else check.message,
            )
        )
    return cases


def engine_cases(report: EngineReport) -> list[Case]:
    """Return the engine check's cases, all of class ``engine``."""
    return [Case("engine", c.name, c.outcome, c.duration_s, c.message) for c in report.checks]


def _text(value: str) -> str:
    return _NOT_XML.sub("\ufffd", value)


_ELEMENTS = {"failed": "failure", "error": "error", "skipped": "skipped"}


def write_junit(
    path: str,
    suite: str,
    cases: Iterable[Case],
    duration_s: float,
    properties: Mapping[str, str] | None = None,
) -> None:
    """Write ``cases`` to ``path`` as one ``testsuite`` named ``suite`` in a ``testsuites`` root.

    The file is readable by its owner only, like the report's files.

    Raises
    ------
    OSError
        If ``path`` cannot be written.
    """
    from ..conformance.report import open_private

    cases = list(cases)
    counts = {kind: sum(c.outcome == kind for c in cases) for kind in _ELEMENTS}
    attributes = {
        "name": suite,
        "tests": str(len(cases)),
        "failures": str(counts["failed"]),
        "errors": str(counts["error"]),
        "skipped": str(counts["skipped"]),
        "time": f"{duration_s:.3f}",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    }
    totals = ("name", "tests", "failures", "errors", "skipped", "time")
    root = ET.Element("testsuites", {key: attributes[key] for key in totals})
    testsuite = ET.SubElement(root, "testsuite", attributes)
    if properties:
        props = ET.SubElement(testsuite, "properties")
        for name, value in properties.items():
            ET.SubElement(props, "property", name=name, value=_text(value))
    for case in cases:
        testcase = ET.SubElement(
            testsuite,
            "testcase",
            classname=_text(case.classname),
            name=_text(case.name),
            time=f"{case.duration_s:.3f}",
        )
        element = _ELEMENTS.get(case.outcome)
        if element is not None:
            message = _text(case.message or case.outcome)
            ET.SubElement(testcase, element, message=message).text = message
    ET.indent(root)
    with open_private(path) as out:
        ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
