"""The fsspec backend: roots it would not own, URL secrets, unreachable servers."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hicache_storage import (
    BackendIOError,
    BackendUnavailableError,
    ConfigError,
    create_backend,
)
from hicache_storage.backends.fsspec import FsspecBackend, FsspecConfig
from hicache_storage.cli import main


def closed_port() -> int:
    """Return a local TCP port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- roots: normalised before the check, refused where the backend would not own them -----------


@pytest.mark.parametrize(
    "url",
    [
        "file:///tmp/..",
        "file:///tmp/../",
        "file:///./",
        "file:///./.",
        "file:////",
        "file:///tmp/x/../..",
        "local:///tmp/..",
    ],
)
def test_local_roots_resolving_to_slash_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="resolves to the filesystem's root /"):
        create_backend("fsspec", {"url": url})


def test_a_symlink_to_slash_is_refused(tmp_path: Path) -> None:
    (tmp_path / "up").symlink_to("/")
    for url in (f"file://{tmp_path}/up", f"file://{tmp_path}/up/", f"file://{tmp_path}/up/."):
        with pytest.raises(ConfigError, match="resolves to the filesystem's root"):
            create_backend("fsspec", {"url": url})


@pytest.mark.parametrize("url", ["file://", "file://localhost/", "file://localhost/tmp/kv"])
def test_file_urls_without_an_absolute_path_are_refused(url: str) -> None:
    """fsspec reads ``file://localhost/x`` as ``./localhost/x``, not as ``/x``."""
    with pytest.raises(ConfigError, match="file:///path"):
        create_backend("fsspec", {"url": url})


def test_a_local_root_is_resolved_and_used_resolved(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    backend = FsspecBackend(FsspecConfig(url=f"file://{tmp_path}/other/../link/kv"))
    assert backend.root == str((tmp_path / "real" / "kv").resolve())
    assert backend.set("k", b"v") and backend.get("k") == b"v"
    backend.clear()
    assert not backend.exists("k")
    backend.close()


@pytest.mark.parametrize(
    "url", ["memory://./", "memory://a/..", "memory://a/./b", "memory://a/%2e%2e/b"]
)
def test_dot_segments_are_refused_where_fsspec_passes_them_on(url: str) -> None:
    with pytest.raises(ConfigError, match=r"'\.' or '\.\.' segment"):
        create_backend("fsspec", {"url": url})


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://", "root"),
        ("s3:///", "root"),
        ("s3://./prefix", "segment"),
        ("s3://bucket/..", "segment"),
        ("s3://bucket/prefix/../..", "segment"),
    ],
)
def test_bucketless_s3_roots_are_refused(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_backend("fsspec", {"url": url})


@pytest.mark.parametrize(("url", "message"), [("http://h/", "root"), ("http://h/./x", "segment")])
def test_a_servers_root_is_refused_below_its_host(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_backend("fsspec", {"url": url})


def test_an_unlistable_local_directory_fails_clear_instead_of_passing_for_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FsspecBackend(FsspecConfig(url=f"file://{tmp_path}/kv"))
    assert backend.set("k", b"v")
    scandir = os.scandir

    def refusing(path: Any) -> Any:
        if os.fspath(path) != backend.root:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(BackendIOError, match="Permission denied"):
        backend.clear()
    monkeypatch.undo()
    assert backend.exists("k")
    backend.close()


# -- secrets in URLs, found the way fsspec (urllib.parse.urlsplit) finds them -------------------


@pytest.mark.parametrize("password", ["s3cr 3t", "s3cr\t3t", "s3@cr 3t@x", "s3cr3t\n"])
def test_a_password_with_whitespace_is_masked_in_the_config_error(password: str) -> None:
    with pytest.raises(ConfigError, match="whitespace") as info:
        create_backend("fsspec", {"url": f"ftp://user:{password}@host/kv"})
    shown = str(info.value)
    assert "ftp://user:***@host/kv" in shown
    assert "s3" not in shown and "3t" not in shown


def test_a_password_with_at_signs_is_masked_whole(tmp_path: Path) -> None:
    port = closed_port()
    url = f"ftp://user:s3@cr:3t@127.0.0.1:{port}/kv"
    config = FsspecConfig(url=url)
    with pytest.raises(BackendUnavailableError) as info:
        FsspecBackend(config)
    for shown in (repr(config), str(info.value)):
        assert f"ftp://user:***@127.0.0.1:{port}/kv" in shown
        assert "s3" not in shown and "cr" not in shown and "3t" not in shown


# -- an unreachable server is unavailable, at construction and in every call ---------------------


def test_a_refused_connection_at_construction_is_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match="could not open the filesystem"):
        FsspecBackend(FsspecConfig(url=f"ftp://127.0.0.1:{closed_port()}/kv"))
    with pytest.raises(BackendUnavailableError):
        create_backend("fsspec", {"url": f"ftp://127.0.0.1:{closed_port()}/kv"})


def test_every_call_on_an_unreachable_server_is_unavailable_not_a_miss() -> None:
    """fsspec's http turns a refused connection into FileNotFoundError; that is no miss."""
    backend = FsspecBackend(FsspecConfig(url=f"http://127.0.0.1:{closed_port()}/kv", deadline_s=5))
    calls: list[Callable[[], Any]] = [
        lambda: backend.get("k"),
        lambda: backend.get("k", bytearray(1)),
        lambda: backend.batch_get(["k"], [bytearray(1)]),
        lambda: backend.exists("k"),
        lambda: backend.batch_exists(["k", "l"]),
        lambda: backend.set("k", b"v"),
        lambda: backend.delete("k"),
        backend.clear,
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError):
            call()
    backend.close()


def test_check_of_an_unreachable_url_is_one_line_and_exit_2() -> None:
    config = f'{{"url": "ftp://u:s3@cr3t@127.0.0.1:{closed_port()}/kv"}}'
    result = CliRunner().invoke(main, ["check", "fsspec", "--config", config])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: cannot open the fsspec backend: ")
    assert "could not open the filesystem" in line and "ftp://u:***@127.0.0.1" in line
    assert "s3" not in line and "cr3t" not in line
