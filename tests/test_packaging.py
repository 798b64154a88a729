"""What the package declares: the core install brings everything its headline command needs."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the CI interpreter is 3.11+
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def _core_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project["dependencies"]:
        name = requirement.split(";")[0]
        for stop in "<>=!~[ ":
            name = name.split(stop)[0]
        names.add(name.strip().lower())
    return names


def _third_party_imports(folder: Path) -> set[str]:
    """Top-level modules imported by the modules of ``folder``, outside the package."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"hicache_storage", "__future__"}


def test_the_conformance_suite_needs_only_core_requirements() -> None:
    """``hicache check`` after a core install: the suite's imports are all core requirements.

    torch is imported by the engine cases only where it is installed (the checks that need it
    import it lazily), so it is held to the same rule while it stays a core requirement.
    """
    needed = _third_party_imports(ROOT / "conformance")
    assert needed, "the suite's modules were found"
    assert needed <= _core_requirements(), sorted(needed - _core_requirements())
