"""Attention for the model's forward: the kernels it may use, and decodes attended as a batch.

- :data:`ATTENTION_BACKENDS` and :func:`attention_kernels`: the ``scaled_dot_product_attention``
  kernels a forward runs on (never cuDNN's), chosen for as long as any forward runs;
- :func:`attention`: one request's new tokens attending causally over its context;
- :class:`Decodes` and :func:`attention_blocks`: a forward's one-token segments attended in one
  padded, masked call a layer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

if TYPE_CHECKING:
    from .model import Segment

__all__ = [
    "ATTENTION_BACKENDS",
    "Attend",
    "Decodes",
    "attention",
    "attention_blocks",
    "attention_kernels",
]

ATTENTION_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The attention kernels a forward may use: every one of ``scaled_dot_product_attention``'s but
cuDNN's. torch 2.11 tries cuDNN first on Hopper for masked attention, and cuDNN builds an
execution plan for each shape it has not met: on the H200, 43-2,146 ms for four masked decodes
over a new context length, against about 1 ms once built, which flash and memory-efficient
attention match without building anything. A serving engine meets a new context length in
nearly every step, so nearly every step with a batch of decodes paid for a plan."""


class _AttentionChoice:
    """Keeps :data:`ATTENTION_BACKENDS` chosen while any forward runs, in any thread.

    ``sdpa_kernel`` sets process-wide flags and puts back what it found when it exits, so two
    forwards overlapping in two threads would put back each other's choice: the one that exits
    last would leave cuDNN off for good, or the first would turn it back on under the other.
    Here the first forward in makes the choice and the last one out puts the old one back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._choice: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the choice for the body of a ``with`` block."""
        with self._lock:
            if self._holders == 0:
                choice = contextlib.ExitStack()
                choice.enter_context(sdpa_kernel(list(ATTENTION_BACKENDS)))
                self._choice = choice
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._choice is not None:
                    choice, self._choice = self._choice, None
                    choice.close()


_ATTENTION_CHOICE = _AttentionChoice()


def attention_kernels() -> contextlib.AbstractContextManager[None]:
    """Keep :data:`ATTENTION_BACKENDS` chosen for the body of a ``with`` block, in any thread."""
    return _ATTENTION_CHOICE.held()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attend ``n`` queries causally over a context whose last ``n`` tokens are theirs.

    Parameters
    ----------
    q
        Queries ``(n, heads, D)``; query ``j`` sits at context position ``c - n + j``.
    k, v
        The context's keys and values ``(c, kv_heads, D)``.

    Returns
    -------
    torch.Tensor
        ``(n, heads * D)``.
    """
    n, heads, dim = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    if n == 1:
        # Decode: the one query sees the whole context, so no mask; the query heads of a group
        # become that key/value head's rows of queries, which avoids expanding K and V.
        qd = q.view(kv_heads, group, dim)
        return F.scaled_dot_product_attention(qd, kt, vt).reshape(1, heads * dim)
    # Query head h reads key/value head h // group (grouped-query attention).
    qg = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
    kg = kt.unsqueeze(1).expand(kv_heads, group, ctx, dim)
    vg = vt.unsqueeze(1).expand(kv_heads, group, ctx, dim)
    if n == ctx:  # no cached prefix: plain causal attention (the fused kernels' fast path)
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=causal_lower_right(n, ctx))
    return out.permute(2, 0, 1, 3).reshape(n, heads * dim)


@dataclass(frozen=True)
class Decodes:
    """Consecutive one-token segments of a forward, attended in one call a layer.

    A forward with many requests in decode would otherwise gather and attend each one's
    context alone, a dozen kernel launches apiece in every layer: on a GPU, where such a
    forward is bound by launches rather than by the bytes it reads, that made a step with
    four decodes take twice as long as a 64-token prefill over the same 8k context. The
    contexts are padded to the longest (the padding repeats a row's own first slot and is
    masked out).
    """

    rows: slice
    slots: torch.Tensor
    """``(B, C)`` pool slots of each row's context, padded to the longest ``C``."""
    mask: torch.Tensor | None
    """``(B, 1, 1, C)``, True where a row's context is; None when no row is padded."""

    @classmethod
    def of(cls, segments: Sequence[Segment], first_row: int) -> Decodes:
        """Batch ``segments`` (one new token each) whose rows start at ``first_row``."""
        lengths = [seg.slots.numel() for seg in segments]
        longest = max(lengths)
        device = segments[0].slots.device
        # Built from the slots where they are, so that nothing waits for the GPU's queue.
        slots = torch.stack(
            [
                torch.cat([seg.slots, seg.slots[:1].expand(longest - n)])
                if n < longest
                else seg.slots
                for seg, n in zip(segments, lengths, strict=True)
            ]
        )
        mask = None
        if min(lengths) < longest:
            span = torch.arange(longest, device=device)
            mask = torch.stack([span < n for n in lengths])[:, None, None, :]
        return cls(slice(first_row, first_row + len(segments)), slots, mask)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """Return the rows' attention output ``(B, heads * D)`` from the forward's ``q``."""
        rows = q[self.rows]
        batch, heads, dim = rows.shape
        kv_heads = k_pool.shape[1]
        # As for one decode: a group's query heads are the rows of queries of its KV head.
        grouped = rows.view(batch, kv_heads, heads // kv_heads, dim)
        k = k_pool[self.slots].transpose(1, 2)
        v = v_pool[self.slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=self.mask)
        return out.reshape(batch, heads * dim)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Layer index, RoPE'd ``q (T, heads, D)``, ``k`` and ``v (T, kv_heads, D)`` to ``(T, heads*D)``."""


def attention_blocks(
    segments: Sequence[Segment], bounds: Sequence[int]
) -> list[Decodes | tuple[Segment, slice]]:
    """Split a forward's segments, in row order, into runs of decodes and single segments."""
    blocks: list[Decodes | tuple[Segment, slice]] = []
    run: list[int] = []

    def close_run() -> None:
        if len(run) > 1:
            blocks.append(Decodes.of([segments[i] for i in run], bounds[run[0]]))
        elif run:
            blocks.append((segments[run[0]], slice(bounds[run[0]], bounds[run[0] + 1])))
        run.clear()

    for i, seg in enumerate(segments):
        if seg.tokens.numel() == 1:
            run.append(i)
            continue
        close_run()
        blocks.append((seg, slice(bounds[i], bounds[i + 1])))
    close_run()
    return blocks
