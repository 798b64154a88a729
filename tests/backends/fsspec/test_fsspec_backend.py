"""The fsspec backend on file://, memory:// and s3://: first-wins, reads in place, v1, errors."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import (
    BackendIOError,
    BufferSizeError,
    ConfigError,
    StorageBackend,
    create_backend,
)
from hicache_storage.backends.fsspec.backend import FsspecBackend
from hicache_storage.backends.fsspec.config import FsspecConfig

from ...helpers import make_pool, page_indices

PACKAGE = Path(__file__).parents[3] / "backends" / "fsspec"
PUBLIC = {
    "hicache_storage",
    "hicache_storage.kit",
    "hicache_storage.backend",
    "hicache_storage.errors",
    "hicache_storage.capabilities",
    "hicache_storage.config",
    "hicache_storage.buffers",
    "hicache_storage.redact",
    "hicache_storage.kit.options",
}
SECRET = "fsspec-secret-canary-7d1e"


@pytest.fixture(params=["file", "memory", "s3"])
def options(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        return {"url": f"file://{tmp_path / 'store'}"}
    if request.param == "memory":
        return {"url": f"memory://unit-{tmp_path.name}"}
    s3: dict[str, Any] = request.getfixturevalue("s3_url_options")
    return s3


@pytest.fixture
def make(options: dict[str, Any]) -> Iterator[Callable[..., StorageBackend]]:
    built: list[StorageBackend] = []

    def build(**overrides: Any) -> StorageBackend:
        backend = create_backend("fsspec", {**options, **overrides})
        built.append(backend)
        return backend

    yield build
    for backend in built:
        if not backend.closed:
            backend.clear()
        backend.close()


def test_set_first_value_wins_across_instances(make: Callable[..., StorageBackend]) -> None:
    one, two = make(), make()
    assert one.set("k1", b"first") and two.set("k1", b"second-value")
    assert bytes(two.get("k1")) == b"first"  # type: ignore[arg-type]
    assert one.batch_set(["k1", "k2"], [b"third", b"two"]) == [True, True]
    assert bytes(one.get("k1")) == b"first" and bytes(one.get("k2")) == b"two"  # type: ignore[arg-type]


def test_concurrent_writers_of_one_key_keep_one_value(make: Callable[..., StorageBackend]) -> None:
    backend = make()
    values = [bytes([i]) * 4096 for i in range(8)]
    barrier = threading.Barrier(len(values))
    seen: list[bytes] = []

    def write(value: bytes) -> None:
        barrier.wait()
        assert backend.set("race", value)
        seen.append(bytes(backend.get("race")))  # type: ignore[arg-type]

    threads = [threading.Thread(target=write, args=(v,)) for v in values]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = bytes(backend.get("race"))  # type: ignore[arg-type]
    assert final in values and set(seen) == {final}


def test_get_reads_into_out_and_checks_its_size(make: Callable[..., StorageBackend]) -> None:
    backend = make()
    assert backend.set("k", b"0123456789")
    out = bytearray(10)
    assert backend.get("k", out) is out and out == b"0123456789"
    short = bytearray(b"untouched")
    with pytest.raises(BufferSizeError):
        backend.get("k", short)
    assert short == b"untouched"
    outs = [bytearray(b"x" * 11), bytearray(10)]
    assert backend.batch_get(["k", "k"], outs) == [False, True]
    assert outs[0] == b"x" * 11 and outs[1] == b"0123456789"
    assert backend.get("missing", bytearray(10)) is None
    assert backend.batch_exists(["k", "missing", "k"]) == 1


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_v1_round_trip_moves_every_byte(make: Callable[..., StorageBackend], kind: str) -> None:
    backend = make()
    source = make_pool(kind, "layer_first")
    source.kv_buffer.view(-1).view(torch.uint8).copy_(
        torch.randint(0, 256, (source.kv_buffer.numel() * source.kv_buffer.element_size(),))
    )
    keys = ["p0", "p1", "p2"]
    backend.register_host_pool(source)
    assert backend.batch_set_v1(keys, page_indices(source, [0, 1, 2])) == [True] * 3
    target = make_pool(kind, "layer_first")
    backend.register_host_pool(target)
    assert backend.batch_get_v1([*keys, "absent"], page_indices(target, [3, 4, 5, 6])) == [
        True,
        True,
        True,
        False,
    ]
    for src, dst in zip([0, 1, 2], [3, 4, 5], strict=True):
        want = b"".join(bytes(v) for v in source.page_buffer_views(page_indices(source, [src]))[0])
        got = b"".join(bytes(v) for v in target.page_buffer_views(page_indices(target, [dst]))[0])
        assert got == want


def test_clear_removes_only_this_roots_objects(make: Callable[..., StorageBackend]) -> None:
    backend = make()
    url = backend.unwrap().url  # type: ignore[attr-defined]
    sibling = make(url=url + "x")
    assert backend.set("a", b"1") and sibling.set("a", b"2")
    backend.clear()
    assert backend.get("a") is None and bytes(sibling.get("a")) == b"2"  # type: ignore[arg-type]


def test_medium_faults_are_typed_errors_or_misses(make: Callable[..., StorageBackend]) -> None:
    backend = make(deadline_s=5.0)
    bare = backend.unwrap()
    assert isinstance(bare, FsspecBackend) and bare.set("k", b"v")
    with bare.medium_faults.armed("io", ops={"write"}), pytest.raises(BackendIOError):
        bare.set("k2", b"v")
    with bare.medium_faults.armed("vanished", ops={"read", "stat"}):
        assert bare.get("k") is None and bare.get("k", bytearray(1)) is None
        assert bare.batch_exists(["k"]) == 0
    assert backend.get("k2") is None and bytes(backend.get("k")) == b"v"  # type: ignore[arg-type]


def test_secrets_masked_in_repr_stats_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = {"secret": SECRET, "nested": {"api_token": SECRET + "2"}}
    parsed = FsspecConfig(url="memory://masked", storage_options=storage)
    assert SECRET not in repr(parsed) and "***" in repr(parsed)
    with pytest.raises(ConfigError) as info:
        create_backend("fsspec", {"url": "memory://masked", "storage_options": storage, "x": 1})
    assert SECRET not in str(info.value)
    with create_backend("fsspec", {"url": "memory://masked", "storage_options": storage}) as b:
        bare = b.unwrap()
        assert isinstance(bare, FsspecBackend)

        def echo(*args: object, **kwargs: object) -> None:
            raise PermissionError(13, f"denied for {SECRET}")

        monkeypatch.setattr(bare.fs, "pipe_file", echo)
        with pytest.raises(BackendIOError) as failed:
            bare.set("k", b"v")
        shown = f"{failed.value} {failed.value!r} {b!r} {bare!r} {b.stats()!r}"
    assert SECRET not in shown and "***" in str(failed.value)


def test_s3_secret_not_in_repr_or_stats(s3_url_options: dict[str, Any]) -> None:
    secret = s3_url_options["storage_options"]["secret"]
    with create_backend("fsspec", s3_url_options) as backend:
        assert backend.set("k", b"v")
        shown = f"{backend!r} {backend.unwrap()!r} {backend.stats()!r}"
    assert secret not in shown


def test_s3_server_down_is_unavailable_within_deadline(s3_url_options: dict[str, Any]) -> None:
    options = {**s3_url_options, "deadline_s": 2.0}
    port = options["storage_options"]["endpoint_url"].rsplit(":", 1)[1]
    closed = options["storage_options"]["endpoint_url"].replace(port, "1")
    options["storage_options"] = {**options["storage_options"], "endpoint_url": closed}
    backend = FsspecBackend(FsspecConfig(**options))
    with pytest.raises((ConnectionError, TimeoutError)) as info:
        backend.get("k")
    assert type(info.value).__module__ == "hicache_storage.errors"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("/no/protocol", "protocol"),
        ("nope://x", "cannot open"),
        ("memory://", "root"),
        ("file:///", "root"),
    ],
)
def test_bad_urls_are_config_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_backend("fsspec", {"url": url})


def test_storage_options_cannot_enable_listing_cache() -> None:
    with pytest.raises(ConfigError, match="use_listings_cache"):
        create_backend(
            "fsspec", {"url": "memory://x", "storage_options": {"use_listings_cache": 1}}
        )


@pytest.mark.parametrize(
    ("block", "url", "extra"),
    [("fsspec", "memory://x", "hicache-storage[fsspec]"), ("s3fs", "s3://b/p", "[fsspec-s3]")],
)
def test_missing_library_names_the_extra(block: str, url: str, extra: str) -> None:
    code = (
        f"import sys; sys.modules[{block!r}] = None\n"
        "from hicache_storage import MissingDependencyError, create_backend\n"
        "try:\n"
        f"    create_backend('fsspec', {{'url': {url!r}}})\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert extra in run.stdout, run.stdout + run.stderr


def test_modules_import_only_the_public_api() -> None:
    """The backend is written against the public author's kit, as a third party would."""
    for module in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if isinstance(node, ast.ImportFrom):
                if node.level or node.module == "__future__":  # its own package; a directive
                    continue
                source = node.module or ""
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                source, names = "", [alias.name for alias in node.names]
            else:
                continue
            where = f"{module.name}:{node.lineno}"
            for name in [source, *names]:
                assert not any(part.startswith("_") for part in name.split(".") if part), where
            for name in [source] if source else names:
                if name.startswith("hicache_storage"):
                    assert name in PUBLIC, f"{where} imports {name}, not part of the public API"


def test_local_batches_report_each_key_and_keep_the_first_value(tmp_path: Path) -> None:
    # file:// batches move on the kit's batch calls: per key, a miss is a miss, a value of
    # another size is a miss, a failing key is a miss of its own beside keys that were read,
    # and fails the call only when no key was read.
    backend = create_backend("fsspec", {"url": f"file://{tmp_path / 'store'}"})
    bare = backend.unwrap()
    assert isinstance(bare, FsspecBackend)
    assert backend.batch_set(["a", "b", "c"], [b"1111", b"2222", b"33"]) == [True] * 3
    assert backend.batch_set(["a", "d"], [b"9999", b"4444"]) == [True, True]
    outs = [bytearray(4) for _ in range(4)]
    assert backend.batch_get(["a", "b", "c", "missing"], outs) == [True, True, False, False]
    assert outs[:3] == [b"1111", b"2222", b"\x00" * 4], "first value wins; a misfit is untouched"
    moved = [bytearray(4), bytearray(4)]
    with bare.medium_faults.armed("io", ops={"read"}, times=1):
        assert bare.batch_get(["a", "d"], moved) == [False, True]
    assert moved == [b"\x00" * 4, b"4444"], "the key after the failing one was still read"
    with bare.medium_faults.armed("io", ops={"read"}, times=1), pytest.raises(BackendIOError):
        bare.batch_get(["a", "missing"], [bytearray(4), bytearray(4)])
    later = [bytearray(4), bytearray(4)]
    assert bare.batch_get(["a", "d"], later) == [True, True] and later == [b"1111", b"4444"]
    assert not [p for p in (tmp_path / "store").rglob("*") if ".tmp." in p.name]
    backend.close()
