"""What an attention call costs the first time it meets a shape, on each of torch's kernels.

A serving engine's forwards attend over context lengths that change nearly every step. A kernel
that builds something per shape (cuDNN builds an execution plan) pays for it in each such step.
This times the engine model's two attention forms, each once at a context length it has not met
and then again at the same one, on torch's default choice of kernel and on each kernel alone:
four masked decodes batched by the engine's own code, and 64 queries over a longer context
(the later query of a stored document). Prints a row per kernel and form, in milliseconds.

    python scripts/probe_attention_shapes.py [--lengths 6]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hicache_storage.engine.attention import Decodes, attention
from hicache_storage.engine.model import Segment

KERNELS: dict[str, list[SDPBackend] | None] = {
    "torch's default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash, efficient": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}
POOL = 40960
KV_HEADS, GROUP, DIM = 8, 4, 128  # the 8B shape's attention


def _ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    """Time each form at new and repeated context lengths on each kernel; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=6, help="new context lengths a row meets")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe times CUDA kernels and needs a GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    k_pool = torch.randn(POOL, KV_HEADS, DIM, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)

    def decodes(longest: int) -> torch.Tensor:
        token = torch.zeros(1, dtype=torch.int64, device=device)
        segments = [
            Segment(token, torch.randint(0, POOL, (longest - 1500 * i,), device=device))
            for i in range(4)
        ]
        q = torch.randn(4, KV_HEADS * GROUP, DIM, device=device, dtype=dtype)
        return Decodes.of(segments, 0).attend(q, k_pool, v_pool)

    def later_query(context: int) -> torch.Tensor:
        q = torch.randn(64, KV_HEADS * GROUP, DIM, device=device, dtype=dtype)
        return attention(q, k_pool[:context], v_pool[:context])

    print(
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "  # type: ignore[no-untyped-call]
        f"{torch.cuda.get_device_name()}"
    )
    length = 12000
    for name, kernels in KERNELS.items():
        for form, call in (("4 decodes", decodes), ("64 queries", later_query)):
            new, again = [], []
            for _ in range(args.lengths):
                length += 37
                with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
                    new.append(_ms(functools.partial(call, length)))
                    again.append(_ms(functools.partial(call, length)))
            print(
                f"{name:17s} {form:10s} new length: "
                + " ".join(f"{x:7.1f}" for x in new)
                + "  | again: "
                + " ".join(f"{x:5.1f}" for x in again)
            )


if __name__ == "__main__":
    main()
