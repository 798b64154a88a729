"""The distribution: a wheel carries every subpackage, the public API is what it says."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

import hicache_storage

ROOT = Path(__file__).resolve().parents[1]
WINGS = {"hicache_storage": "hicache_storage", "backends": "hicache_storage/backends"}
WINGS |= {"conformance": "hicache_storage/conformance", "kernels": "hicache_storage/kernels"}
"""Source folders and where the wheel puts them ([tool.setuptools.package-dir])."""


def subpackages() -> list[str]:
    """Every package of the source tree, by its path in the wheel: none may be left out."""
    found = []
    for folder, installed in WINGS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder).as_posix()
            found.append(installed if relative == "." else f"{installed}/{relative}")
    return found


def test_the_package_list_names_every_package_of_the_source_tree() -> None:
    """A build reuses ``build/``, so a wheel built here may hold a package the list forgets."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = sorted({p.replace("/", ".") for p in subpackages()} - set(listed))
    assert not missing, f"add to [tool.setuptools] packages: {missing}"


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
    packages = subpackages()
    assert "hicache_storage/quota" in packages and "hicache_storage/backends/chain" in packages
    missing = [package for package in packages if f"{package}/__init__.py" not in names]
    assert not missing, f"packages left out of the wheel ([tool.setuptools] packages): {missing}"
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
