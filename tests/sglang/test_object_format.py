"""Through SGLang's factory: rank facts only from SGLang; objects that say what they hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage.errors import ConfigError
from hicache_storage.keys import page_hashes

from .helpers import PAGE, fill_random, make_pools, read_pages, set_rank
from .test_adapter import build


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HICACHE_DEPLOYMENT__TP_RANK", "0"),
        ("HICACHE_DEPLOYMENT__TP_SIZE", "1"),
        ("HICACHE_DEPLOYMENT__MODEL_NAME", "other/model"),
        ("HICACHE_DEPLOYMENT__IS_MLA", "true"),
        ("HICACHE_DEPLOYMENT__PP_SIZE", "2"),
    ],
)
def test_an_environment_that_contradicts_sglangs_rank_is_refused(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_rank(1, 2)
    monkeypatch.setenv(variable, value)
    pools = make_pools("mha", "page_first")
    with pytest.raises(ConfigError, match="contradicts SGLang"):
        build({"backend": "memory"}, pools.host, tp_rank=1, tp_size=2)


def test_an_environment_that_agrees_with_sglang_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_rank(1, 2)
    monkeypatch.setenv("HICACHE_DEPLOYMENT__TP_RANK", "1")
    pools = make_pools("mha", "page_first")
    backend = build({"backend": "memory"}, pools.host, tp_rank=1, tp_size=2)
    assert backend.config.deployment.tp_rank == 1
    backend.close()


def _write_pages(backend: Any, host: Any, hashes: list[str], seed: int) -> list[torch.Tensor]:
    src = host.alloc(len(hashes) * PAGE)
    pages = fill_random(host, src, seed)
    assert backend.batch_set_v1(hashes, src) == [True] * len(hashes)
    return pages


def _read_pages(backend: Any, host: Any, hashes: list[str]) -> tuple[list[bool], Any]:
    dst = host.alloc(len(hashes) * PAGE)
    return backend.batch_get_v1(hashes, dst), dst


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ({"layout": "layer_first"}, {"layout": "page_first"}),
        ({"dtype": torch.float16}, {"dtype": torch.bfloat16}),
        ({"layers": 3}, {"layers": 2}),
    ],
    ids=["layout", "dtype", "layers"],
)
@pytest.mark.parametrize("name", ["memory", "file"])
def test_a_reader_of_another_format_misses(
    name: str, writer: dict[str, Any], reader: dict[str, Any], tmp_path: Path
) -> None:
    """Memory: one adapter re-registers a pool; file: a second adapter over the directory."""
    set_rank()
    extra: dict[str, Any] = {"backend": name}
    if name == "file":
        extra["options"] = {"root": str(tmp_path)}
    hashes = page_hashes(range(2 * PAGE), PAGE)
    shape = {"layout": "page_first", **writer}
    first = make_pools("mha", **shape)
    backend = build(extra, first.host)
    _write_pages(backend, first.host, hashes, seed=3)
    second = make_pools("mha", **{**shape, **reader})
    if name == "memory":
        reader_backend = backend
        reader_backend.register_mem_pool_host(second.host)
    else:
        backend.close()
        reader_backend = build(extra, second.host)
    hits, _ = _read_pages(reader_backend, second.host, hashes)
    assert hits == [False, False], "a page written in another format must be a miss"
    assert reader_backend.batch_exists(hashes) == 0
    reader_backend.close()


def test_sglang_file_compat_refuses_a_pool_of_another_format(tmp_path: Path) -> None:
    set_rank()
    extra = {"backend": "file", "options": {"root": str(tmp_path), "naming": "sglang_file_compat"}}
    hashes = page_hashes(range(2 * PAGE), PAGE)
    first = make_pools("mha", "layer_first")
    backend = build(extra, first.host)
    pages = _write_pages(backend, first.host, hashes, seed=4)
    backend.close()

    with pytest.raises(ConfigError, match="layer_first layout"):
        build(extra, make_pools("mha", "page_first").host)

    same = make_pools("mha", "layer_first")
    again = build(extra, same.host)
    hits, dst = _read_pages(again, same.host, hashes)
    assert hits == [True, True]
    got = read_pages(same.host, dst)
    assert all(torch.equal(a, b) for a, b in zip(got, pages, strict=True))
    again.close()
