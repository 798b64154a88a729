"""The distribution: a wheel carries every subpackage, the public API is what it says."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hicache_storage

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = [
    "hicache_storage",
    "hicache_storage/backends",
    "hicache_storage/backends/file",
    "hicache_storage/backends/memory",
    "hicache_storage/cli",
    "hicache_storage/conformance",
    "hicache_storage/hostpool",
    "hicache_storage/keys",
    "hicache_storage/kernels",
    "hicache_storage/layers",
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("hicache_storage-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_contains_every_subpackage(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for package in SUBPACKAGES:
        assert f"{package}/__init__.py" in names, package
    assert "hicache_storage/py.typed" in names
    assert "hicache_storage/backends/file/plugin.py" in names
    assert not any(name.startswith(("tests/", "backends/", "conformance/")) for name in names)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the checked-read helper is x86-64 only"
)
def test_wheel_carries_the_checked_read_helper_and_its_stub(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "hicache_storage/kit/_checkedio.pyi" in names
    assert any(
        name.startswith("hicache_storage/kit/_checkedio.") and name.endswith(".so")
        for name in names
    ), "the native checked reads did not build (is a C compiler installed?)"


def test_wheel_declares_entry_points_and_extras(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[hicache_storage.backends]" in text
    assert "file = hicache_storage.backends.file.plugin" in text
    assert "hicache = hicache_storage.cli:main" in text
    (metadata,) = [n for n in wheel.namelist() if n.endswith("METADATA")]
    extras = {
        line.split(":", 1)[1].strip()
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Provides-Extra:")
    }
    assert {"redis", "s3", "mooncake", "3fs", "gpu", "test", "dev", "all"} <= extras


def test_public_api_is_sorted_and_importable() -> None:
    names = list(hicache_storage.__all__)
    assert names == sorted(names)
    for name in names:
        assert getattr(hicache_storage, name) is not None
    assert isinstance(hicache_storage.__version__, str)


def test_errors_derive_from_root_and_builtins() -> None:
    from hicache_storage import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, hicache_storage.HiCacheError)
        assert cls in (hicache_storage.HiCacheError, hicache_storage.BackendError) or any(
            base.__module__ == "builtins" and base is not Exception for base in cls.__mro__
        ), name


def test_nothing_reads_the_shared_folder() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("hicache_storage", "backends", "conformance", "kernels", "tests", "examples")
        for path in (ROOT / folder).rglob("*.py")
        if "../shared" in path.read_text(encoding="utf-8").replace("test_nothing_reads", "")
        and path.name != "test_packaging.py"
    ]
    assert offenders == []


def _core_requirements() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
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
