"""The file backend over a root that holds what it did not write (issue 48, items 3 and 7).

Only a regular file is a value. A FIFO, a directory, a socket or a symlink to one (or to nothing)
at a key's path is a miss that never waits (a FIFO's ``open`` waits for a writer forever), never
a stored key, and never keeps the key from being stored. One file that cannot be read costs its
own key in a batch, not the batch; a fan-out directory that cannot be listed costs what it holds,
not the store.

Tests run as root, whom permission bits do not stop: the unreadable cases run in a subprocess
that drops to ``nobody`` (as any other user, the subprocess keeps its user, whom the bits stop).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import create_backend
from hicache_storage.backends.file import FileBackend, FileConfig
from hicache_storage.errors import BackendIOError

from .test_file_backend import fill, indices, make_pool, page_of

WAIT_S = 20.0
"""How long a call may take before it counts as hung (it takes milliseconds)."""

KINDS = ["fifo", "directory", "full-directory", "socket", "symlink-to-fifo", "dangling-symlink"]


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A store root with a short path (a UNIX socket's path is at most 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="hf", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def plant(path: str, kind: str) -> list[socket.socket]:
    """Put an entry of ``kind`` at ``path``; return the sockets to close afterwards."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    held: list[socket.socket] = []
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "full-directory":
        os.mkdir(path)
        Path(path, "someone-elses").write_bytes(b"kept")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        held.append(sock)
    elif kind == "symlink-to-fifo":
        os.mkfifo(path + "-target")
        os.symlink(path + "-target", path)
    else:
        os.symlink(path + "-nowhere", path)
    return held


def bounded(call: Callable[[], Any], unblock: str | None = None) -> Any:
    """Return ``call()``, failing the test if it has not returned within :data:`WAIT_S`.

    A call stuck opening the FIFO ``unblock`` is released afterwards (a writer opens it), so a
    failing test does not leave a thread behind.
    """
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        if unblock is not None:
            fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        thread.join(WAIT_S)
        pytest.fail(f"the call was still waiting after {WAIT_S} s (it opened a FIFO, blocking)")
    outcome, value = box[0]
    if outcome == "raised":
        raise value
    return value


def fifo_of(path: str, kind: str) -> str | None:
    return {"fifo": path, "symlink-to-fifo": path + "-target"}.get(kind)


@pytest.mark.parametrize("integrity", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_that_is_not_a_file_is_a_miss_never_waited_on_and_never_stored(
    short_root: Path, kind: str, integrity: bool
) -> None:
    backend = FileBackend(FileConfig(root=str(short_root), integrity=integrity))
    pool = make_pool("mha", "layer_first", pages=4)
    fill(pool, None)
    backend.register_host_pool(pool)
    page = bytes(page_of(pool, 1))
    assert backend.batch_set_v1(["good"], indices(pool, [1])) == [True]
    path = backend.path_of("bad")
    held = plant(path, kind)
    fifo = fifo_of(path, kind)
    try:
        assert not bounded(lambda: backend.exists("bad"), fifo)
        assert bounded(lambda: backend.batch_exists(["bad", "good"]), fifo) == 0
        assert bounded(lambda: backend.get("bad"), fifo) is None
        assert bounded(lambda: backend.get("bad", bytearray(len(page))), fifo) is None
        target = make_pool("mha", "layer_first", pages=4)
        fill(target, 0xA5)
        backend.register_host_pool(target)
        # One page goes through the Python route, two through the native batch.
        assert bounded(lambda: backend.batch_get_v1(["bad"], indices(target, [0])), fifo) == [False]
        got = bounded(lambda: backend.batch_get_v1(["bad", "good"], indices(target, [0, 2])), fifo)
        assert got == [False, True]
        assert page_of(target, 2) == page and set(page_of(target, 0)) == {0xA5}
        outs = [bytearray(len(page)), bytearray(len(page))]
        assert bounded(lambda: backend.batch_get(["bad", "good"], outs), fifo) == [False, True]
        assert outs[1] == page
        # A store of the key is not refused nor answered "stored" without storing: the value
        # takes the entry's place.
        assert backend.set("bad", b"v" * len(page))
        assert backend.exists("bad")
        assert backend.get("bad") == b"v" * len(page)
        assert os.path.isfile(path) and not os.path.islink(path)
        if kind == "full-directory":  # moved aside, never deleted: the store wrote none of it
            kept = [p for p in Path(path).parent.rglob("someone-elses")]
            assert [p.read_bytes() for p in kept] == [b"kept"]
    finally:
        for sock in held:
            sock.close()
        backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_pages_replaces_entries_that_are_not_files(short_root: Path, kind: str) -> None:
    # batch_set_v1 publishes many pages in one native call: an entry that is not a file is
    # handed back (not published over by link) and replaced, so every page is stored.
    backend = create_backend("file", {"root": str(short_root)})
    pool = make_pool("mla", "page_first", pages=4)
    fill(pool, None)
    backend.register_host_pool(pool)
    bare = backend.unwrap()
    assert isinstance(bare, FileBackend)
    keys = ["x0", "x1", "x2"]
    held = [s for key in keys[:2] for s in plant(bare.path_of(key), kind)]
    try:
        assert backend.batch_set_v1(keys, indices(pool, [0, 1, 2])) == [True] * 3
        target = make_pool("mla", "page_first", pages=4)
        backend.register_host_pool(target)
        assert backend.batch_get_v1(keys, indices(target, [0, 1, 2])) == [True] * 3
        assert [page_of(target, p) for p in range(3)] == [page_of(pool, p) for p in range(3)]
    finally:
        for sock in held:
            sock.close()
        backend.close()


def test_delete_of_a_directory_at_a_keys_path_says_nothing_was_there(short_root: Path) -> None:
    with FileBackend(FileConfig(root=str(short_root))) as backend:
        plant(backend.path_of("d"), "directory")
        assert backend.delete("d") is False


# -- files and directories the backend cannot read (item 7) ------------------------------------

_AS_ANOTHER_USER = textwrap.dedent(
    """
    import json, os, sys, tempfile
    import torch
    from hicache_storage import create_backend
    from hicache_storage.hostpool import MHAHostPool

    KEYS = ["k0", "k1", "k2", "k3"]

    def pool():
        return MHAHostPool(16, 4, 3, 2, 8, torch.bfloat16, "layer_first", pin_memory=False)

    def idx(pages):
        return torch.cat([torch.arange(p * 4, p * 4 + 4) for p in pages])

    def pages(p):
        out = []
        for i in range(4):
            b = bytearray(p.page_nbytes)
            p.read_page(i * 4, b)
            out.append(bytes(b))
        return out

    def unreadable_page(backend, bare):
        report = {}
        source = pool()
        flat = source.kv_buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
        backend.register_host_pool(source)
        assert backend.batch_set_v1(KEYS, idx([0, 1, 2, 3])) == [True] * 4
        os.chmod(bare.path_of("k1"), 0)  # unreadable to an unprivileged user
        written = pages(source)
        for name, target in (("bare", bare), ("layers", backend)):
            dest = pool()
            dest.kv_buffer.view(-1).view(torch.uint8).fill_(0xA5)
            target.register_host_pool(dest)
            hits = target.batch_get_v1(KEYS, idx([0, 1, 2, 3]))
            got = pages(dest)
            report[name] = {
                "hits": hits,
                "right": [got[i] == written[i] for i in range(4)],
                "untouched": set(got[1]) == {0xA5},
            }
            outs = [bytearray(len(written[0])) for _ in KEYS]
            report[name + "-batch_get"] = {
                "hits": target.batch_get(KEYS, outs),
                "right": [bytes(o) == w for o, w in zip(outs, written)],
            }
        report["read_errors"] = bare.stats()["read_errors"]
        try:
            bare.batch_get_v1(["k1"], idx([0]))
            report["alone"] = "no error"
        except Exception as exc:
            report["alone"] = type(exc).__name__
        return report

    def unlistable_directory(backend, bare):
        stored = [k for k in ("a%d" % i for i in range(64)) if backend.set(k, b"v" * 100)]
        return {
            "stored": len(stored),
            "read": sum(backend.get(k) == b"v" * 100 for k in stored),
            "unlisted": bare.stats()["unlisted_dirs"],
        }

    def check(root, mode):
        backend = create_backend("file", {"root": root})
        try:
            return (unreadable_page if mode == "file" else unlistable_directory)(
                backend, backend.unwrap()
            )
        finally:
            backend.close()

    root, mode = sys.argv[1], sys.argv[2]
    if os.geteuid() == 0:
        # Once as root on a scratch store, so every module the check needs is loaded (the
        # interpreter's own files may be where nobody cannot look), then as nobody.
        with tempfile.TemporaryDirectory() as scratch:
            check(scratch, mode)
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
    print(json.dumps(check(root, mode)))
    """
)


def run_unprivileged(root: Path, mode: str) -> dict[str, Any]:
    """Run the check above as a user the permission bits stop (``nobody`` when we are root).

    The subprocess starts as this user, imports what it needs (the interpreter's own files may
    be where ``nobody`` cannot look), then drops to ``nobody`` before it opens the store.
    """
    root.parent.chmod(0o755)
    root.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)
    done = subprocess.run(
        [sys.executable, "-c", _AS_ANOTHER_USER, str(root), mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_one_unreadable_page_file_costs_its_page_only(short_root: Path) -> None:
    store = short_root / "store"
    store.mkdir()
    report = run_unprivileged(store, "file")
    for layers in ("bare", "layers"):
        assert report[layers]["hits"] == [True, False, True, True], report
        assert report[layers]["right"] == [True, False, True, True], report
        assert report[layers]["untouched"], "the unreadable page's slots were written"
        assert report[layers + "-batch_get"]["hits"] == [True, False, True, True], report
        assert report[layers + "-batch_get"]["right"] == [True, False, True, True], report
    assert report["read_errors"] >= 4, "the failed reads beside hits are counted"
    # Alone in its batch, the failure is raised: the layers count it as a medium failure.
    assert report["alone"] == "BackendIOError"


@pytest.mark.parametrize(("level", "mode"), [(1, 0o000), (2, 0o744)])
def test_a_fanout_directory_that_cannot_be_listed_leaves_the_rest_served(
    short_root: Path, level: int, mode: int
) -> None:
    # mode 000: another tenant's umask 077 (this user is not its owner once dropped); 744 on a
    # second-level directory: its names list, but not one of its files can be looked at.
    store = short_root / "store"
    with FileBackend(FileConfig(root=str(store))) as backend:
        assert backend.set("a0", b"v" * 100)
        hidden = Path(backend.path_of("a0")).parents[2 - level]
    hidden.chmod(mode)
    report = run_unprivileged(store, "directory")
    assert report["unlisted"] == [str(hidden)]
    assert report["stored"] >= 56, "keys of the other fan-out directories are stored"
    assert report["read"] == report["stored"]


def test_clear_clears_what_it_can_list_then_names_what_it_cannot(
    short_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FileBackend(FileConfig(root=str(short_root)))
    keys = [f"c{i}" for i in range(32)]
    for key in keys:
        assert backend.set(key, b"v")
    hidden = Path(backend.path_of(keys[0])).parent
    scandir = os.scandir

    def refusing(path: Any) -> Any:
        if os.fspath(path) == str(hidden):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(BackendIOError, match="Permission denied"):
        backend.clear()
    monkeypatch.undo()
    left = [key for key in keys if os.path.exists(backend.path_of(key))]
    assert left and all(Path(backend.path_of(key)).parent == hidden for key in left)
    backend.close()
