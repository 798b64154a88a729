"""Transfer kernels: the Triton kernel, run on CPU tensors under TRITON_INTERPRET=1, and the torch
reference, each against an oracle that indexes the host pool by its layout (not by strides).

Every destination is poisoned with random bytes and lives inside a larger buffer whose other
bytes (unlisted slots, other layers, guard bands before and after) must come out unchanged, so a
kernel that writes outside its slots, or skips one, fails. ``test_checker_catches_*`` prove that.

CI runs a fixed (derandomized) set of 100 hypothesis examples, so a landing never hangs on a
lucky draw; set HICACHE_KERNEL_EXAMPLES (e.g. 500) for a nightly run, which draws fresh examples
each time. Whatever a fresh draw finds is kept as an ``@example``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hicache_storage.errors import (
    BatchMismatchError,
    ConfigError,
    HostPoolError,
    IndexAlignmentError,
    InvalidValueError,
)
from hicache_storage.hostpool import Layout, MHAHostPool, MLAHostPool
from hicache_storage.kernels import Backend, DevicePool, HostView, KernelConfig, KVTransfer

EXAMPLES = int(os.environ.get("HICACHE_KERNEL_EXAMPLES", "100"))
DERANDOMIZE = "HICACHE_KERNEL_EXAMPLES" not in os.environ
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
GUARD = 96  # elements of canary before and after every buffer (and between device layers)
BACKENDS: list[Backend] = ["triton", "reference"]
MLA_LAYOUTS = [layout for layout in Layout if layout is not Layout.PAGE_HEAD]


@pytest.fixture(scope="module", autouse=True)
def interpreter() -> Iterator[None]:
    """Run the Triton kernel on CPU tensors: set before the kernel module is first imported."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


def random_bytes(count: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    nbytes = count * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).view(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class Setup:
    """A device pool and a host view, each carved out of one guarded, randomly filled buffer."""

    device: DevicePool
    device_storage: torch.Tensor
    host: HostView
    host_storage: torch.Tensor
    layout: Layout | None
    mla: bool

    def host_row(self, buffer: torch.Tensor, kv: int, layer: int, slot: int) -> torch.Tensor:
        """Row ``(kv, layer, slot)`` of a pool-shaped buffer, found by its layout's own indexing."""
        part = buffer if self.mla else buffer[kv]
        page = self.host.page_size
        if self.layout is Layout.LAYER_FIRST:
            return part[layer, slot]
        if self.layout is Layout.PAGE_FIRST:
            return part[slot, layer]
        if self.layout is Layout.PAGE_FIRST_DIRECT:
            return part[slot // page, layer, slot % page]
        if self.layout is Layout.PAGE_HEAD:
            return part[slot // page, :, slot % page, layer]
        # The custom layout of ``custom_setup``: (layer, kv, slot, *row).
        return buffer[layer, kv, slot]


def make_setup(
    *,
    mla: bool,
    dtype: torch.dtype,
    layers: int,
    heads: int,
    dim: int,
    page_size: int,
    host_pages: int,
    device_size: int,
    layout: Layout,
    seed: int,
) -> Setup:
    generator = torch.Generator().manual_seed(seed)
    size = host_pages * page_size
    pool: MHAHostPool | MLAHostPool
    if mla:
        pool = MLAHostPool(size, page_size, layers, dim, dtype, layout, pin_memory=False)
        row_shape: tuple[int, ...] = (1, dim)
    else:
        pool = MHAHostPool(size, page_size, layers, heads, dim, dtype, layout, pin_memory=False)
        row_shape = (heads, dim)
    shape = tuple(pool.kv_buffer.shape)
    host_storage = random_bytes(2 * GUARD + pool.kv_buffer.numel(), dtype, generator)
    buffer = host_storage[GUARD : GUARD + pool.kv_buffer.numel()].view(shape)
    host = dataclasses.replace(HostView.from_pool(pool), buffer=buffer)
    kv = 1 if mla else 2
    layer_elems = device_size * math.prod(row_shape)
    device_storage = random_bytes(GUARD + kv * layers * (layer_elems + GUARD), dtype, generator)
    tensors = []
    for index in range(kv * layers):
        start = GUARD + index * (layer_elems + GUARD)
        tensors.append(device_storage[start : start + layer_elems].view(device_size, *row_shape))
    device = DevicePool(tensors[:layers], None if mla else tensors[layers:])
    return Setup(device, device_storage, host, host_storage, layout, mla)


def custom_setup(seed: int) -> Setup:
    """A host buffer in no pool layout at all: ``(layer, kv, slot, heads, dim)``."""
    generator = torch.Generator().manual_seed(seed)
    layers, size, heads, dim, dtype = 3, 12, 2, 4, torch.bfloat16
    row = heads * dim
    host_storage = random_bytes(2 * GUARD + layers * 2 * size * row, dtype, generator)
    buffer = host_storage[GUARD:-GUARD].view(layers, 2, size, heads, dim)
    host = HostView(
        buffer=buffer,
        num_kv=2,
        layer_num=layers,
        size=size,
        page_size=4,
        row_shape=(heads, dim),
        stride_kv=size * row,
        stride_layer=2 * size * row,
        stride_page=4 * row,
        stride_token=row,
    )
    device_storage = random_bytes(2 * layers * 10 * row, dtype, generator)
    tensors = list(device_storage.view(2 * layers, 10, heads, dim).unbind(0))
    device = DevicePool(tensors[:layers], tensors[layers:])
    return Setup(device, device_storage, host, host_storage, None, mla=False)


def problems(
    setup: Setup,
    before: tuple[torch.Tensor, torch.Tensor],
    dev_idx: list[int],
    host_idx: list[int],
    *,
    to_host: bool,
    layer: int | None,
) -> list[str]:
    """Compare both buffers with what a correct transfer leaves; describe every difference."""
    device_before, host_before = before
    expected_device, expected_host = device_before.clone(), host_before.clone()
    host_shape = setup.host.buffer.shape
    expected_buffer = expected_host[GUARD : GUARD + setup.host.buffer.numel()].view(host_shape)
    element = setup.device.dtype.itemsize
    layers = range(setup.device.layer_num) if layer is None else [layer]
    for kv, part in enumerate(setup.device.buffers):
        for index in layers:
            tensor = part[index]
            offset = (tensor.data_ptr() - setup.device_storage.data_ptr()) // element
            device_layer = expected_device[offset : offset + tensor.numel()].view(tensor.shape)
            source_layer = device_before[offset : offset + tensor.numel()].view(tensor.shape)
            for dev, host in zip(dev_idx, host_idx, strict=True):
                host_row = setup.host_row(expected_buffer, kv, index, host)
                if to_host:
                    host_row.copy_(source_layer[dev])
                else:
                    device_layer[dev].copy_(host_row)
    found = []
    for name, actual, expected in (
        ("device", setup.device_storage, expected_device),
        ("host", setup.host_storage, expected_host),
    ):
        wrong = torch.nonzero(as_bytes(actual) != as_bytes(expected)).flatten() // element
        inside = (wrong >= GUARD) & (wrong < actual.numel() - GUARD)
        for where, hits in (("the buffer", wrong[inside]), ("a guard band", wrong[~inside])):
            if hits.numel():
                first = int(hits[0])
                found.append(f"{name}: {hits.numel()} bytes differ in {where}, first at {first}")
    return found


def run(
    setup: Setup,
    dev_idx: list[int],
    host_idx: list[int],
    *,
    to_host: bool,
    layer: int | None,
    backend: Backend,
    config: KernelConfig | None = None,
    sm_budget: int | None = None,
    max_gbps: float | None = None,
) -> None:
    transfer = KVTransfer(
        setup.device, setup.host, backend=backend, config=config, sm_budget=sm_budget
    )
    assert transfer.backend == backend
    if to_host:
        transfer.backup(
            torch.tensor(dev_idx, dtype=torch.int64),
            torch.tensor(host_idx, dtype=torch.int64),
            layer=layer,
            max_gbps=max_gbps,
        )
    else:
        transfer.load(
            torch.tensor(host_idx, dtype=torch.int64),
            torch.tensor(dev_idx, dtype=torch.int64),
            layer=layer,
            max_gbps=max_gbps,
        )


@dataclass(frozen=True)
class Case:
    mla: bool
    dtype: torch.dtype
    layers: int
    heads: int
    dim: int
    page_size: int
    host_pages: int
    device_size: int
    layout: Layout
    dev_idx: list[int]
    host_idx: list[int]
    to_host: bool
    layer: int | None
    config: KernelConfig
    sm_budget: int | None
    max_gbps: float | None
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    mla = draw(st.booleans())
    layers = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 4]))
    host_pages = draw(st.integers(1, 5))
    device_size = draw(st.integers(1, 20))
    host_size = host_pages * page_size
    count = draw(st.integers(0, min(host_size, device_size)))
    if draw(st.booleans()) and count >= page_size:
        # Whole pages in a shuffled order, as the engine sends them.
        pages = draw(st.permutations(range(host_pages)))[: count // page_size]
        host_idx = [p * page_size + o for p in pages for o in range(page_size)]
        count = len(host_idx)
    else:
        host_idx = draw(st.permutations(range(host_size)))[:count]
    dev_idx = draw(st.permutations(range(device_size)))[:count]
    return Case(
        mla=mla,
        dtype=draw(st.sampled_from(DTYPES)),
        layers=layers,
        heads=draw(st.integers(1, 3)),
        dim=draw(st.sampled_from([3, 8, 24, 36] if mla else [1, 2, 3, 8, 24])),
        page_size=page_size,
        host_pages=host_pages,
        device_size=device_size,
        layout=draw(st.sampled_from(MLA_LAYOUTS if mla else list(Layout))),
        dev_idx=dev_idx,
        host_idx=host_idx,
        to_host=draw(st.booleans()),
        layer=draw(st.none() | st.integers(0, layers - 1)),
        config=KernelConfig(
            tile_bytes=draw(st.sampled_from([16, 96, 512, 32768])),
            max_chunk_bytes=draw(st.sampled_from([8, 32, 512])),
            balance_rounds=draw(st.sampled_from([0, 4])),
        ),
        sm_budget=draw(st.sampled_from([None, 1, 3])),
        max_gbps=draw(st.sampled_from([None, 40.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def setup_for(case: Case) -> Setup:
    return make_setup(
        mla=case.mla,
        dtype=case.dtype,
        layers=case.layers,
        heads=case.heads,
        dim=case.dim,
        page_size=case.page_size,
        host_pages=case.host_pages,
        device_size=case.device_size,
        layout=case.layout,
        seed=case.seed,
    )


def snapshot(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    return setup.device_storage.clone(), setup.host_storage.clone()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(
    max_examples=EXAMPLES,
    derandomize=DERANDOMIZE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
@example(  # 12 tokens, tiles of 14: the layer-filling path once computed tiles of zero layers
    case=Case(
        mla=True,
        dtype=torch.uint8,
        layers=2,
        heads=1,
        dim=36,
        page_size=4,
        host_pages=3,
        device_size=12,
        layout=Layout.LAYER_FIRST,
        dev_idx=list(range(12)),
        host_idx=list(range(12)),
        to_host=False,
        layer=None,
        config=KernelConfig(tile_bytes=512, max_chunk_bytes=8),
        sm_budget=None,
        max_gbps=None,
        seed=0,
    )
)
def test_transfer_moves_exactly_the_listed_slots(backend: Backend, case: Case) -> None:
    setup = setup_for(case)
    before = snapshot(setup)
    run(
        setup,
        case.dev_idx,
        case.host_idx,
        to_host=case.to_host,
        layer=case.layer,
        backend=backend,
        config=case.config,
        sm_budget=case.sm_budget,
        max_gbps=case.max_gbps,
    )
    assert (
        problems(setup, before, case.dev_idx, case.host_idx, to_host=case.to_host, layer=case.layer)
        == []
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", MLA_LAYOUTS)
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_transfer_moves_mla_576_rows_of_bf16(
    backend: Backend, layout: Layout, to_host: bool
) -> None:
    setup = make_setup(
        mla=True,
        dtype=torch.bfloat16,
        layers=2,
        heads=1,
        dim=576,
        page_size=4,
        host_pages=3,
        device_size=16,
        layout=layout,
        seed=7,
    )
    dev_idx, host_idx = [9, 2, 14, 5, 0, 11], [8, 9, 10, 11, 1, 6]
    before = snapshot(setup)
    run(setup, dev_idx, host_idx, to_host=to_host, layer=None, backend=backend)
    assert problems(setup, before, dev_idx, host_idx, to_host=to_host, layer=None) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_transfer_needs_no_pool_layout(backend: Backend, to_host: bool) -> None:
    setup = custom_setup(seed=3)
    dev_idx, host_idx = [4, 0, 9, 7, 2], [11, 3, 4, 0, 8]
    before = snapshot(setup)
    run(setup, dev_idx, host_idx, to_host=to_host, layer=1, backend=backend)
    assert problems(setup, before, dev_idx, host_idx, to_host=to_host, layer=1) == []
    run(setup, dev_idx, host_idx, to_host=to_host, layer=None, backend=backend)
    assert problems(setup, before, dev_idx, host_idx, to_host=to_host, layer=None) == []


def small_setup(layout: Layout = Layout.PAGE_FIRST) -> Setup:
    return make_setup(
        mla=False,
        dtype=torch.float16,
        layers=2,
        heads=2,
        dim=8,
        page_size=4,
        host_pages=4,
        device_size=12,
        layout=layout,
        seed=11,
    )


@pytest.mark.parametrize("layout", list(Layout))
def test_checker_catches_a_kernel_writing_one_host_slot_off(layout: Layout) -> None:
    setup = small_setup(layout)
    dev_idx, host_idx = [3, 7, 1], [4, 9, 14]
    before = snapshot(setup)
    shifted = [slot + 1 for slot in host_idx]
    run(setup, dev_idx, shifted, to_host=True, layer=None, backend="triton")
    found = problems(setup, before, dev_idx, host_idx, to_host=True, layer=None)
    assert len(found) == 1 and found[0].startswith("host:")


def test_checker_catches_a_kernel_writing_one_device_slot_off() -> None:
    setup = small_setup()
    dev_idx, host_idx = [3, 7, 1], [4, 9, 14]
    before = snapshot(setup)
    run(setup, [slot + 1 for slot in dev_idx], host_idx, to_host=False, layer=0, backend="triton")
    found = problems(setup, before, dev_idx, host_idx, to_host=False, layer=0)
    assert len(found) == 1 and found[0].startswith("device:")


def test_checker_catches_a_write_into_the_guard_band() -> None:
    setup = small_setup(Layout.LAYER_FIRST)
    before = snapshot(setup)
    # Host slot 15 of the last layer's V half is the buffer's last row: shifting it one row on
    # lands the write in the guard band after the buffer.
    view = dataclasses.replace(setup.host, buffer=setup.host.buffer.view(-1)[16:])
    transfer = KVTransfer(setup.device, view, backend="triton")
    transfer.backup(torch.tensor([2]), torch.tensor([15]), layer=1)
    found = problems(setup, before, [2], [15], to_host=True, layer=1)
    assert any(line.startswith("host:") and "guard band" in line for line in found)


def test_checker_catches_a_slot_left_unwritten() -> None:
    setup = small_setup()
    dev_idx, host_idx = [3, 7, 1], [4, 9, 14]
    before = snapshot(setup)
    run(setup, dev_idx[:2], host_idx[:2], to_host=True, layer=None, backend="triton")
    found = problems(setup, before, dev_idx, host_idx, to_host=True, layer=None)
    assert len(found) == 1 and found[0].startswith("host:")


def test_transfer_of_no_slots_changes_nothing() -> None:
    setup = small_setup()
    before = snapshot(setup)
    for backend in BACKENDS:
        run(setup, [], [], to_host=True, layer=None, backend=backend)
        run(setup, [], [], to_host=False, layer=1, backend=backend)
    assert problems(setup, before, [], [], to_host=True, layer=None) == []


def test_transfer_accepts_a_host_pool_object() -> None:
    pool = MHAHostPool(8, 4, 2, 2, 4, torch.float32, "page_first_direct", pin_memory=False)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    device = DevicePool.mha(10, 2, 2, 4, torch.float32)
    KVTransfer(device, pool, backend="triton").load([4, 5, 6, 7], [9, 0, 3, 1])
    for layer in range(2):
        for dev, host in zip([9, 0, 3, 1], [4, 5, 6, 7], strict=True):
            assert torch.equal(device.buffers[0][layer][dev], pool.kv_buffer[0, 1, layer, host - 4])
            assert torch.equal(device.buffers[1][layer][dev], pool.kv_buffer[1, 1, layer, host - 4])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", [None, 1])
def test_transfer_page_head_follows_sglang_addressing(backend: Backend, layer: int | None) -> None:
    layers, heads, dim, page_size = 3, 2, 4, 4
    storage = torch.randn(2 * 3 * heads * page_size * layers * dim + 8)
    pool = MHAHostPool.from_buffer(
        storage[8:].view(2, 3, heads, page_size, layers, dim), page_size, "page_head"
    )
    device = DevicePool.mha(10, layers, heads, dim, torch.float32)
    for part in device.buffers:
        for tensor in part:
            tensor.copy_(torch.randn(tensor.shape))
    transfer = KVTransfer(device, pool, backend=backend)
    dev_idx, host_idx = [9, 0, 3, 1, 6], [4, 5, 6, 7, 9]
    transfer.backup(dev_idx, host_idx, layer=layer)
    flat = pool.kv_buffer.view(2, -1)
    for kv in range(2):
        for index in range(layers) if layer is None else [layer]:
            for dev, slot in zip(dev_idx, host_idx, strict=True):
                page, offset = divmod(slot, page_size)
                for head in range(heads):
                    at = ((page * heads + head) * page_size + offset) * layers * dim + index * dim
                    expected = device.buffers[kv][index][dev, head]
                    assert torch.equal(flat[kv, at : at + dim], expected)
    before = [t.clone() for part in device.buffers for t in part]
    device_copy = DevicePool.mha(10, layers, heads, dim, torch.float32)
    KVTransfer(device_copy, pool, backend=backend).load(host_idx, dev_idx, layer=layer)
    for kv in range(2):
        for index in range(layers) if layer is None else [layer]:
            rows = device_copy.buffers[kv][index][dev_idx]
            assert torch.equal(rows, before[kv * layers + index][dev_idx])


def test_plan_splits_page_head_rows_into_heads() -> None:
    from hicache_storage.kernels.triton_kernels import plan_transfer

    pool = MHAHostPool(16, 4, 3, 2, 64, torch.bfloat16, "page_head", pin_memory=False)
    device = DevicePool.mha(8, 3, 2, 64, torch.bfloat16)
    plan = plan_transfer(device, HostView.from_pool(pool), KernelConfig(max_chunk_bytes=64))
    assert (plan.word_bytes, plan.chunk, plan.chunks_per_row, plan.chunks_per_head) == (8, 8, 4, 2)
    assert plan.host_strides[4] * plan.align == 4 * 3 * 64 * 2 // 8
    contiguous = MHAHostPool(16, 4, 3, 2, 64, torch.bfloat16, "page_first", pin_memory=False)
    plan = plan_transfer(device, HostView.from_pool(contiguous), KernelConfig())
    assert plan.chunks_per_head == plan.chunks_per_row and plan.host_strides[4] == 0


def test_transfer_rejects_mismatched_pools() -> None:
    device = DevicePool.mha(8, 2, 2, 4, torch.float16)
    other_dtype = MHAHostPool(8, 4, 2, 2, 4, torch.bfloat16, pin_memory=False)
    with pytest.raises(InvalidValueError, match="never converts"):
        KVTransfer(device, other_dtype)
    other_rows = MHAHostPool(8, 4, 2, 1, 4, torch.float16, pin_memory=False)
    with pytest.raises(HostPoolError, match="do not match"):
        KVTransfer(device, other_rows)
    mla = MLAHostPool(8, 4, 2, 8, torch.float16, pin_memory=False)
    with pytest.raises(HostPoolError, match="do not match"):
        KVTransfer(device, mla)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transfer_rejects_bad_indices(backend: Backend) -> None:
    setup = small_setup()
    transfer = KVTransfer(setup.device, setup.host, backend=backend)
    with pytest.raises(BatchMismatchError, match="3 device indices but 2 host"):
        transfer.backup([0, 1, 2], [0, 1])
    with pytest.raises(IndexAlignmentError, match=r"outside \[0, 16\)"):
        transfer.backup([0, 1], [0, 16])
    with pytest.raises(IndexAlignmentError, match=r"outside \[0, 12\)"):
        transfer.load([0, 1], [-1, 2])
    with pytest.raises(IndexAlignmentError, match="1-D integer"):
        transfer.load(torch.tensor([0.0, 1.0]), [0, 1])
    with pytest.raises(HostPoolError, match=r"layer 2 is outside \[0, 2\)"):
        transfer.load([0], [0], layer=2)


def test_backend_auto_falls_back_to_reference_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = small_setup()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert KVTransfer(setup.device, setup.host).backend == "reference"
    with pytest.raises(HostPoolError, match="needs a CUDA device pool"):
        KVTransfer(setup.device, setup.host, backend="triton")


def test_sm_budget_must_be_positive() -> None:
    setup = small_setup()
    transfer = KVTransfer(setup.device, setup.host, backend="reference")
    with pytest.raises(ConfigError, match="positive int or None"):
        transfer.sm_budget = 0
    transfer.sm_budget = 8
    assert transfer.sm_budget == 8


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "40"])
def test_max_gbps_must_be_a_positive_number(bad: object) -> None:
    setup = small_setup()
    transfer = KVTransfer(setup.device, setup.host, backend="triton")
    before = snapshot(setup)
    with pytest.raises(ConfigError, match="max_gbps must be a positive number"):
        transfer.backup([0, 1], [2, 3], max_gbps=bad)  # type: ignore[arg-type]
    assert problems(setup, before, [], [], to_host=True, layer=None) == []


@settings(max_examples=EXAMPLES, derandomize=DERANDOMIZE, deadline=None)
@given(
    n_tokens=st.integers(1, 5000),
    tokens=st.integers(1, 300),
    units=st.integers(1, 200),
    programs=st.integers(1, 140),
)
def test_split_tokens_never_loads_the_busiest_program_more(
    n_tokens: int, tokens: int, units: int, programs: int
) -> None:
    from hicache_storage.kernels.triton_kernels import split_tokens

    def busiest(tile_tokens: int) -> int:
        tiles = units * math.ceil(n_tokens / tile_tokens)
        return math.ceil(tiles / programs) * tile_tokens

    tile_tokens = split_tokens(n_tokens, tokens, units, programs)
    assert 1 <= tile_tokens <= tokens
    assert busiest(tile_tokens) <= busiest(tokens)


def test_split_tokens_fills_the_last_round_of_a_short_launch() -> None:
    from hicache_storage.kernels.triton_kernels import split_tokens

    # MLA, one layer of 256 one-token pages on 8 programs: tiles of 28 tokens make 10 tiles, so
    # two programs would carry twice the others' bytes; tiles of 16 give every program two.
    assert split_tokens(256, 28, 1, 8) == 16
    assert split_tokens(256, 32, 2, 8) == 32  # 16 tiles on 8 programs: already even
    assert split_tokens(4096, 28, 1, 8) == 28  # many rounds: the tail is a small share
    assert split_tokens(256, 28, 1, 8, balance_rounds=0) == 28


def test_pace_spreads_the_rate_over_the_programs() -> None:
    from hicache_storage.kernels.triton_kernels import pace_nanoseconds

    pace = pace_nanoseconds(32768, 8, 40.0)
    assert pace == 6554  # 8 programs each moving 32 KiB per 6.554 µs: 40 GB/s in all
    assert 32768 * 8 / pace == pytest.approx(40.0, rel=1e-3)


HOPPER_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hicache_storage.kernels.triton_kernels import _transfer_kernel

names = list(_transfer_kernel.arg_names)
pointers = {"dev_ptr", "dev_offsets_ptr", "host_ptr", "dev_index_ptr", "host_index_ptr"}
report = {}
for paced, pdl in ((False, False), (True, False), (False, True)):
    constants = dict(CHUNK=16, CHUNKS_PER_ROW=2, CHUNKS_PER_HEAD=2, ALIGN=16, PAGE=1, TOKENS=8,
                     LAYERS=1, SLOTS=16, TOKEN_MAJOR=False, TO_HOST=True, PACED=paced, PDL=pdl)
    signature = {n: "constexpr" if n in constants else "*i64" if n in pointers else "i64"
                 for n in names}
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    try:
        built = triton.compile(ASTSource(_transfer_kernel, signature, constexprs, aligned),
                               target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:
        print(json.dumps({"unavailable": str(exc)}))
        sys.exit(0)
    ptx = built.asm["ptx"]
    report[f"{paced}-{pdl}"] = {
        "timer": "%globaltimer" in ptx,
        "wait": "griddepcontrol.wait" in ptx,
        "trigger": "griddepcontrol.launch_dependents" in ptx,
        "wide": "st.global.v2.b64" in ptx and "st.global.b64" not in ptx,
        "cubin": len(built.asm["cubin"]) > 0,
    }
print(json.dumps(report))
"""


def test_kernel_compiles_for_hopper_with_pacing_and_pdl() -> None:
    """The GPU-only variants (GPU timer, programmatic dependent launch) build for sm_90.

    The interpreter cannot run them, so CI at least compiles them, in a process without
    TRITON_INTERPRET, down to a cubin with Triton's own ptxas, and checks that the PTX uses what
    each needs and still stores 16 bytes at a time when the pointers are 16-byte aligned.
    """
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-c", HOPPER_BUILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"this Triton build cannot compile sm_90 code: {report['unavailable']}")
    built = {"wide": True, "cubin": True}
    assert report == {
        "False-False": {"timer": False, "wait": False, "trigger": False, **built},
        "True-False": {"timer": True, "wait": False, "trigger": False, **built},
        "False-True": {"timer": False, "wait": True, "trigger": True, **built},
    }


def test_host_view_rejects_strides_past_its_buffer() -> None:
    view = custom_setup(seed=1).host
    with pytest.raises(HostPoolError, match="storage holds"):
        dataclasses.replace(view, layer_num=view.layer_num + 1)
    with pytest.raises(HostPoolError, match="multiple of page_size"):
        dataclasses.replace(view, page_size=5)


def test_plan_uses_wide_words_and_power_of_two_chunks_for_mla() -> None:
    from hicache_storage.kernels.triton_kernels import plan_transfer

    pool = MLAHostPool(8, 4, 2, 576, torch.bfloat16, "page_first", pin_memory=False)
    device = DevicePool.mla(8, 2, 576, torch.bfloat16)
    plan = plan_transfer(device, HostView.from_pool(pool), KernelConfig())
    assert (plan.word_bytes, plan.chunk, plan.chunks_per_row) == (8, 16, 9)
    assert plan.all_layers.token_major and not plan.per_layer.token_major


def test_bench_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_storage.bench.kernels import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the benchmark itself is run by hand")
    assert main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
