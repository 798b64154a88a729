"""A Llama-style decoder in plain torch that attends over a paged, layer-first device KV pool.

The model is what makes a KV cache hierarchy worth having: recomputing a prefix costs real
compute, reusing it costs a copy. :class:`LlamaModel` writes each new token's K and V of layer
``i`` into ``pool.buffers[0][i]`` / ``pool.buffers[1][i]`` at the token's slot and attends over the
request's whole context through its slots, so a prefix whose KV the cache has put in the pool
(from the GPU, the host or storage) is never recomputed. The engine passes a ``layer_ready`` hook
that waits until layer ``i``'s prefix KV has landed, so loading layer ``i + 1`` overlaps computing
layer ``i``.

A forward takes a batch of segments (:class:`Segment`), one per request: the new tokens and the
slots of the request's whole context, the new tokens' slots last. A token's position is its index
in its context. :meth:`LlamaModel.generate_no_cache` recomputes everything without a pool; it is
the oracle that the cache must match token for token.

Attention itself, the kernels it runs on and the batching of decodes, is
:mod:`hicache_storage.engine.attention`'s.

Weights are seeded random (no download), each matrix drawn with standard deviation
``1 / sqrt(fan_in)`` and the output projections of attention and MLP scaled down by
``1 / sqrt(2 * layers)``, so activations stay of order one however wide or deep the model is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from hicache_storage.errors import ConfigError, HostPoolError, InvalidValueError
from hicache_storage.keys import model_identity
from hicache_storage.kit.options import positive_int

from .attention import Attend, Decodes, attention, attention_blocks, attention_kernels

__all__ = [
    "DTYPES",
    "KVPool",
    "LayerHook",
    "LayerWeights",
    "LlamaModel",
    "ModelConfig",
    "Segment",
    "WEIGHT_SAMPLES",
    "next_token",
    "spaced_indices",
]

WEIGHT_SAMPLES = 64
"""Elements of each weight matrix, evenly spaced, that :attr:`LlamaModel.identity` covers: other
weights differ in nearly every element, so a few per matrix tell two models apart."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The model's floating-point types by name (a ``config.json``'s ``torch_dtype``, ``--dtype``)."""

LayerHook = Callable[[int], None]
"""Called with a layer index right before the forward touches that layer of the pool."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-style decoder, its numerics and the seed of its random weights.

    Parameters
    ----------
    vocab_size
        Number of token ids.
    hidden
        Width of the residual stream.
    layers
        Number of decoder layers.
    heads
        Query heads per layer.
    kv_heads
        Key/value heads per layer (grouped-query attention); must divide ``heads``.
    head_dim
        Width of one head; even, as RoPE rotates pairs of elements.
    intermediate
        Width of the SwiGLU MLP.
    rope_theta
        Base of the RoPE frequencies.
    rms_eps
        Epsilon of RMSNorm.
    dtype
        Floating-point type of the weights, the activations and the KV pool.
    seed
        Seed of the random weights.

    Raises
    ------
    ConfigError
        If a size is not a positive integer, ``kv_heads`` does not divide ``heads``, ``head_dim``
        is odd, ``rope_theta`` or ``rms_eps`` is not positive, or ``dtype`` is not floating-point.
    """

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate": self.intermediate,
        }
        for name, value in sizes.items():
            positive_int(f"model {name}", value, ConfigError, noun="integer")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}): "
                f"each key/value head serves a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model head_dim must be even for RoPE, which rotates pairs, got {self.head_dim}"
            )
        for name, number in (("rope_theta", self.rope_theta), ("rms_eps", self.rms_eps)):
            if not (isinstance(number, (int, float)) and math.isfinite(number) and number > 0):
                raise ConfigError(f"model {name} must be a positive finite number, got {number!r}")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ConfigError(f"model dtype must be a floating-point torch.dtype, got {self.dtype}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"model seed must be an integer, got {self.seed!r}")

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """Return a CPU-sized float32 GQA config for tests; ``overrides`` replace its fields."""
        base = cls(
            vocab_size=512,
            hidden=64,
            layers=3,
            heads=4,
            kv_heads=2,
            head_dim=16,
            intermediate=128,
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def llama3_8b(cls, **overrides: Any) -> ModelConfig:
        """Return the Llama-3-8B shape in bfloat16; ``overrides`` replace its fields."""
        base = cls(
            vocab_size=128256,
            hidden=4096,
            layers=32,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate=14336,
            rope_theta=500000.0,
            rms_eps=1e-5,
            dtype=torch.bfloat16,
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def llama3_70b_layers(cls, layers: int = 20, **overrides: Any) -> ModelConfig:
        """Return ``layers`` layers of the Llama-3-70B shape in bfloat16 (80 in the real model).

        Twenty layers (17 B parameters, 34 GB of weights) fit one large GPU with room for KV;
        each token costs a 70B model's compute per layer and 80 KiB of KV.
        """
        shape = {"hidden": 8192, "layers": layers, "heads": 64, "intermediate": 28672}
        return cls.llama3_8b(**{**shape, **overrides})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Return the shape of a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3).

        Only the shape is taken (the weights stay seeded random): vocabulary, hidden width,
        layers, attention and KV heads, head dim (``head_dim``, else hidden / heads), MLP width,
        RoPE base, RMSNorm epsilon and ``torch_dtype`` (bfloat16 when absent).

        Raises
        ------
        ConfigError
            If the architecture is not of those families or a field is missing or invalid.
        """
        families = ("llama", "mistral", "qwen2", "qwen3")
        kind = str(config.get("model_type", "")).lower()
        if kind not in families:
            raise ConfigError(
                f"config.json model_type {config.get('model_type')!r} is not one of {families} "
                "(dense decoders with grouped-query attention)"
            )
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
            dtype = DTYPES.get(dtype_name)
            if dtype is None:
                raise ConfigError(f"config.json torch_dtype {dtype_name!r} is not a float dtype")
            base = cls(
                vocab_size=int(config["vocab_size"]),
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate=int(config["intermediate_size"]),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                rms_eps=float(config.get("rms_norm_eps", 1e-5)),
                dtype=dtype,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json of a {kind} model lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has an invalid field: {exc}") from None
        return dataclasses.replace(base, **overrides)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


class KVPool(Protocol):
    """The paged KV pool a forward reads and writes: a :class:`~hicache_storage.kernels.DevicePool`.

    Build one for a model with ``DevicePool.mha(size, c.layers, c.kv_heads, c.head_dim, c.dtype,
    device)``: per layer a K and a V tensor ``(size, kv_heads, head_dim)``, indexed by slot.
    """

    @property
    def buffers(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per K/V, per layer, the ``(size, *row_shape)`` tensor."""

    @property
    def num_kv(self) -> int:
        """2 for K and V."""

    @property
    def layer_num(self) -> int:
        """Number of layers."""

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one slot's row, ``(kv_heads, head_dim)``."""

    @property
    def dtype(self) -> torch.dtype:
        """Element type."""

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""


@dataclass(frozen=True)
class LayerWeights:
    """The weights of one decoder layer; a matrix ``(out, in)`` is applied as ``x @ w.T``.

    Attributes
    ----------
    attn_norm
        RMSNorm weight before attention, ``(hidden,)``.
    wqkv
        Fused Q, K and V projections, ``((heads + 2 * kv_heads) * head_dim, hidden)``.
    wo
        Attention output projection, ``(hidden, heads * head_dim)``.
    mlp_norm
        RMSNorm weight before the MLP, ``(hidden,)``.
    w_gate_up
        Fused SwiGLU gate and up projections, ``(2 * intermediate, hidden)``.
    w_down
        SwiGLU down projection, ``(hidden, intermediate)``.
    """

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class Segment:
    """One request's part of a forward: its new tokens and the slots of its whole context.

    Parameters
    ----------
    tokens
        The new token ids, ``(n,)`` int64 on the model's device, ``n >= 1``.
    slots
        Pool slots of the request's context, ``(c,)`` int64 on the pool's device, ``c >= n``:
        the first ``c - n`` hold the KV of the tokens before (their positions ``0 .. c - n - 1``);
        the forward writes the new tokens' KV into the last ``n``.

    Raises
    ------
    InvalidValueError
        If ``tokens`` or ``slots`` is not a 1-D int64 tensor.
    HostPoolError
        If ``tokens`` is empty or ``slots`` is shorter than ``tokens``.
    """

    tokens: torch.Tensor
    slots: torch.Tensor

    def __post_init__(self) -> None:
        for name, tensor in (("tokens", self.tokens), ("slots", self.slots)):
            if tensor.dim() != 1 or tensor.dtype != torch.int64:
                raise InvalidValueError(
                    f"segment {name} must be a 1-D int64 tensor, got {tuple(tensor.shape)} "
                    f"{tensor.dtype}"
                )
        if self.tokens.numel() == 0:
            raise HostPoolError("a segment needs at least one new token")
        if self.slots.numel() < self.tokens.numel():
            raise HostPoolError(
                f"segment has {self.tokens.numel()} new tokens but only {self.slots.numel()} "
                f"context slots; the slots must cover the cached prefix and every new token"
            )

    @property
    def prefix_len(self) -> int:
        """Tokens of the context whose KV is already in the pool."""
        return self.slots.numel() - self.tokens.numel()


def next_token(logits: torch.Tensor) -> int:
    """Pick the greedy next token from ``(vocab,)`` logits (the first maximum on ties)."""
    return int(torch.argmax(logits).item())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last axis to unit root-mean-square in float32, then scale by ``weight``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``(T, heads, D)`` by RoPE, pairing element ``j`` with ``j + D/2`` (Llama's layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


GRAPH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""A forward's new tokens, padded up to one of these, whose layers replay CUDA graphs."""


class _LayerGraphs:
    """Each layer's parts around attention as two CUDA graphs, for forwards of a few tokens.

    Such a forward is bound by its kernel launches, not by its work: measured on the H200 with
    the 8B shape, a 64-token forward took 36.6 ms while its kernels ran for 16.3 ms. Replaying
    a layer's norms, projections, RoPE and MLP as graphs leaves only the attention (it reads the
    pool, whose slots differ every forward, and the per-layer load hook runs before it) to
    launch op by op. The tokens are padded up to the next of :data:`GRAPH_TOKENS` inside static
    buffers; the padded rows are computed and dropped (every op of these parts is row-wise).
    ``capture=False`` runs the same buffers and padding without graphs (a CPU, for tests).
    """

    def __init__(self, model: LlamaModel, *, capture: bool) -> None:
        self.model = model
        self.capture = capture
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        if capture:  # before any clock starts, not in the first forward of each size
            for size in GRAPH_TOKENS:
                self._prepare(size)

    @staticmethod
    def fits(tokens: int) -> bool:
        """Whether a forward of ``tokens`` new tokens runs on the graphs."""
        return tokens <= GRAPH_TOKENS[-1]

    def decode(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Run every layer over ``h (n, hidden)``; return the last layer's ``(n, hidden)``."""
        n = h.shape[0]
        size = next(b for b in GRAPH_TOKENS if b >= n)
        buf = self._buffers.get(size) or self._prepare(size)
        buf["h"][:n].copy_(h)
        buf["h"][n:].zero_()
        buf["cos"][:n].copy_(cos)
        buf["sin"][:n].copy_(sin)
        graphs = self._graphs.get(size)
        for i, layer in enumerate(self.model.layers):
            if graphs is None:
                self._before(layer, buf)
            else:
                graphs[i][0].replay()
            buf["attn"][:n].copy_(attend(i, buf["q"][:n], buf["k"][:n], buf["v"][:n]))
            if graphs is None:
                self._after(layer, buf)
            else:
                graphs[i][1].replay()
        return buf["h"][:n].clone()

    def _before(self, layer: LayerWeights, buf: dict[str, torch.Tensor]) -> None:
        q, k, v = self.model._qkv(layer, buf["h"], buf["cos"], buf["sin"])
        buf["q"].copy_(q)
        buf["k"].copy_(k)
        buf["v"].copy_(v)

    def _after(self, layer: LayerWeights, buf: dict[str, torch.Tensor]) -> None:
        buf["h"].copy_(self.model._after_attention(layer, buf["h"], buf["attn"]))

    def _prepare(self, size: int) -> dict[str, torch.Tensor]:
        """Allocate a size's static buffers and, on a GPU, capture its graphs for every layer."""
        c = self.model.config
        device = self.model.device

        def zeros(*shape: int, dtype: torch.dtype = c.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        buf = {
            "h": zeros(size, c.hidden),
            "cos": zeros(size, 1, c.head_dim // 2, dtype=torch.float32),
            "sin": zeros(size, 1, c.head_dim // 2, dtype=torch.float32),
            "q": zeros(size, c.heads, c.head_dim),
            "k": zeros(size, c.kv_heads, c.head_dim),
            "v": zeros(size, c.kv_heads, c.head_dim),
            "attn": zeros(size, c.heads * c.head_dim),
        }
        self._buffers[size] = buf
        if self.capture:
            self._graphs[size] = self._capture(buf)
        return buf

    def _capture(
        self, buf: dict[str, torch.Tensor]
    ) -> list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]]:
        device = buf["h"].device
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up (cuBLAS handles, workspaces) off the graph
            layer = self.model.layers[0]
            self._before(layer, buf)
            self._after(layer, buf)
        torch.cuda.current_stream(device).wait_stream(side)
        graphs = []
        for layer in self.model.layers:
            before, after = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(before, pool=self._pool):
                self._before(layer, buf)
            with torch.cuda.graph(after, pool=self._pool):
                self._after(layer, buf)
            graphs.append((before, after))
        buf["h"].zero_()
        return graphs


def spaced_indices(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """Return ``count`` evenly spaced indices into ``numel`` elements, first and last included.

    Integer steps: a float32 ``linspace`` rounds past the last index of a matrix of 2**24 or
    more elements (the 8B shape's embedding has 5.3e8), which a GPU gather turns into an assert.
    """
    steps = torch.arange(count, dtype=torch.int64, device=device)
    return steps * (numel - 1) // max(count - 1, 1)


class LlamaModel:
    """A Llama-style decoder with seeded random weights: RMSNorm, RoPE, GQA, SwiGLU.

    Parameters
    ----------
    config
        The shape, numerics and seed.
    device
        Where the weights live and the forward runs; the weights are drawn there, from a
        generator seeded with ``config.seed``.
    graphs
        Run forwards of at most ``GRAPH_TOKENS[-1]`` new tokens through static buffers, each
        layer's parts around attention replayed as CUDA graphs (captured here, for every size).
        Default: on a CUDA device. True on a CPU runs the same buffers without graphs.

    Notes
    -----
    Inference only: the weights are plain tensors that need no gradient. The LM head is separate
    from the embedding, as in Llama 3; RoPE is unscaled.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        *,
        graphs: bool | None = None,
    ) -> None:
        self.config = config
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        out_scale = 1.0 / math.sqrt(2 * config.layers)

        def matrix(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
            weight = torch.empty((rows, cols), dtype=config.dtype, device=device)
            return weight.normal_(0.0, scale / math.sqrt(cols), generator=generator)

        def ones() -> torch.Tensor:
            return torch.ones(config.hidden, dtype=config.dtype, device=device)

        c = config
        self.embedding = matrix(c.vocab_size, c.hidden, math.sqrt(c.hidden))
        self.layers = tuple(
            LayerWeights(
                attn_norm=ones(),
                wqkv=matrix((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden),
                wo=matrix(c.hidden, c.heads * c.head_dim, out_scale),
                mlp_norm=ones(),
                w_gate_up=matrix(2 * c.intermediate, c.hidden),
                w_down=matrix(c.hidden, c.intermediate, out_scale),
            )
            for _ in range(c.layers)
        )
        self.final_norm = ones()
        self.lm_head = matrix(c.vocab_size, c.hidden)
        self.device = self.embedding.device
        half = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.device)
        self._inv_freq = 1.0 / (c.rope_theta ** (half / c.head_dim))
        facts = {**dataclasses.asdict(c), "dtype": str(c.dtype), "weights": self.device.type}
        self.identity = model_identity("seeded-llama", self._weights_fingerprint(), facts)
        """The model's name for stored KV: a digest of the whole config (shape, numerics, dtype,
        seed, where the weights were drawn) and of the weights themselves, sampled: CPU and CUDA
        generators, or two torch releases, may draw other numbers from one seed. Models with
        other weights have another identity, so they never share pages."""
        cuda = self.device.type == "cuda"
        wanted = cuda if graphs is None else graphs
        self._graphs = _LayerGraphs(self, capture=cuda) if wanted else None

    def _weights_fingerprint(self) -> str:
        """Return a digest of the weights: each matrix's shape and some of its elements.

        :data:`WEIGHT_SAMPLES` elements per matrix, evenly spaced, copied to the host at once, so
        it is cheap at any model size.
        """
        matrices = [self.embedding, self.lm_head]
        for layer in self.layers:
            matrices += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        samples = []
        for matrix in matrices:
            flat = matrix.reshape(-1)
            count = min(WEIGHT_SAMPLES, flat.numel())
            at = spaced_indices(flat.numel(), count, flat.device)
            samples.append(flat.index_select(0, at).float())
        digest = hashlib.blake2b(digest_size=16)
        digest.update(json.dumps([list(m.shape) for m in matrices]).encode())
        digest.update(torch.cat(samples).cpu().numpy().tobytes())
        return digest.hexdigest()

    def forward(
        self,
        segments: Sequence[Segment],
        pool: KVPool,
        *,
        layer_ready: LayerHook | None = None,
        all_logits: bool = False,
    ) -> list[torch.Tensor]:
        """Compute a batch of requests' new tokens over the pool, writing their KV into it.

        Parameters
        ----------
        segments
            One per request; their slots must be disjoint where they write.
        pool
            The device KV pool, shaped for this model (see :class:`KVPool`).
        layer_ready
            Called with ``i`` once per layer, in order, right before layer ``i`` writes or reads
            the pool; it may block until that layer's prefix KV is in place.
        all_logits
            Return every new token's logits instead of only the last one's.

        Returns
        -------
        list[torch.Tensor]
            Per segment, float32 logits: ``(n, vocab)`` with ``all_logits``, else ``(vocab,)``.

        Raises
        ------
        HostPoolError
            If there are no segments or the pool does not fit the model.
        InvalidValueError
            If a segment's tensors are not on the model's or the pool's device.
        """
        self._check_pool(pool)
        if not segments:
            raise HostPoolError("a forward needs at least one segment")
        for seg in segments:
            if seg.tokens.device != self.device or seg.slots.device != pool.device:
                raise InvalidValueError(
                    f"segment tokens must be on the model's device {self.device} and slots on the "
                    f"pool's {pool.device}; got {seg.tokens.device} and {seg.slots.device}"
                )
        tokens = torch.cat([seg.tokens for seg in segments])
        positions = torch.cat(
            [
                torch.arange(seg.prefix_len, seg.slots.numel(), device=self.device)
                for seg in segments
            ]
        )
        write_slots = torch.cat([seg.slots[seg.prefix_len :] for seg in segments])
        bounds = [0]
        for seg in segments:
            bounds.append(bounds[-1] + seg.tokens.numel())
        blocks = attention_blocks(segments, bounds)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer_ready is not None:
                layer_ready(layer)
            k_pool, v_pool = pool.buffers[0][layer], pool.buffers[1][layer]
            k_pool[write_slots] = k
            v_pool[write_slots] = v
            outs = [
                block.attend(q, k_pool, v_pool)
                if isinstance(block, Decodes)
                else attention(q[block[1]], k_pool[block[0].slots], v_pool[block[0].slots])
                for block in blocks
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        hidden = self._decode(tokens, positions, attend)
        if all_logits:
            return list(
                self._logits(hidden).split_with_sizes([seg.tokens.numel() for seg in segments])
            )
        return list(self._logits(hidden[[b - 1 for b in bounds[1:]]]).unbind(0))

    def forward_no_cache(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute a whole sequence from scratch with plain causal attention and no pool.

        Parameters
        ----------
        tokens
            ``(n,)`` int64 token ids on the model's device.

        Returns
        -------
        torch.Tensor
            Float32 logits ``(n, vocab)``.
        """

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, k, v)

        positions = torch.arange(tokens.numel(), device=self.device)
        return self._logits(self._decode(tokens, positions, attend))

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        pool: KVPool,
        slots: torch.Tensor,
        *,
        cached: int = 0,
    ) -> list[int]:
        """Continue ``prompt`` greedily, one request through the pool.

        Parameters
        ----------
        prompt
            Token ids.
        max_new_tokens
            Tokens to generate, at least 1.
        pool
            The device KV pool.
        slots
            The request's slots, int64 on the pool's device, at least
            ``len(prompt) + max_new_tokens - 1`` (the last token's KV is never needed): token
            ``t`` of prompt-and-output has its KV at ``slots[t]``.
        cached
            Leading prompt tokens whose KV is already at their slots; the prefill computes the
            rest (at least one token).

        Returns
        -------
        list[int]
            The ``max_new_tokens`` generated ids.

        Raises
        ------
        HostPoolError
            If ``cached`` leaves no prompt token to compute or ``slots`` is too short.
        """
        if not 0 <= cached < len(prompt):
            raise HostPoolError(
                f"cached ({cached}) must leave at least one of the {len(prompt)} prompt tokens "
                f"to compute"
            )
        if max_new_tokens < 1 or slots.numel() < len(prompt) + max_new_tokens - 1:
            raise HostPoolError(
                f"{max_new_tokens} new tokens after a {len(prompt)}-token prompt need "
                f"{len(prompt) + max_new_tokens - 1} slots, got {slots.numel()}"
            )
        new = torch.tensor(prompt[cached:], dtype=torch.int64, device=self.device)
        logits = self.forward([Segment(new, slots[: len(prompt)])], pool)[0]
        out = [next_token(logits)]
        for ctx in range(len(prompt) + 1, len(prompt) + max_new_tokens):
            last = torch.tensor(out[-1:], dtype=torch.int64, device=self.device)
            out.append(next_token(self.forward([Segment(last, slots[:ctx])], pool)[0]))
        return out

    def generate_no_cache(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Continue ``prompt`` greedily, recomputing the whole sequence for every token.

        This is the oracle: no pool, no slots, no reuse.
        """
        seq = list(prompt)
        for _ in range(max_new_tokens):
            tokens = torch.tensor(seq, dtype=torch.int64, device=self.device)
            seq.append(next_token(self.forward_no_cache(tokens)[-1]))
        return seq[len(prompt) :]

    def _check_pool(self, pool: KVPool) -> None:
        """Raise :class:`HostPoolError` unless ``pool`` holds this model's K and V rows."""
        c = self.config
        mine = (2, c.layers, (c.kv_heads, c.head_dim), c.dtype, self.device)
        theirs = (pool.num_kv, pool.layer_num, pool.row_shape, pool.dtype, pool.device)
        if mine != theirs:
            raise HostPoolError(
                f"the pool's (kv, layers, row shape, dtype, device) = {theirs} do not fit the "
                f"model's {mine}"
            )

    def _decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Run the decoder layers over ``(T,)`` tokens; return the final-normed ``(T, hidden)``.

        Attention runs on :data:`~hicache_storage.engine.attention.ATTENTION_BACKENDS` only while
        any forward runs (the choice is process-wide while it lasts, as ``sdpa_kernel`` makes
        it).
        """
        freqs = positions.float()[:, None, None] * self._inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        h = F.embedding(tokens, self.embedding)
        graphs = self._graphs
        with attention_kernels():
            if graphs is not None and graphs.fits(tokens.numel()):
                h = graphs.decode(h, cos, sin, attend)
            else:
                for i, layer in enumerate(self.layers):
                    h = self._after_attention(layer, h, attend(i, *self._qkv(layer, h, cos, sin)))
        return _rms_norm(h, self.final_norm, self.config.rms_eps)

    def _qkv(
        self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return a layer's queries and keys (RoPE'd) and values, from its input ``h``."""
        c = self.config
        qkv = F.linear(_rms_norm(h, layer.attn_norm, c.rms_eps), layer.wqkv)
        qk, v = qkv.view(h.shape[0], c.heads + 2 * c.kv_heads, c.head_dim).split_with_sizes(
            [c.heads + c.kv_heads, c.kv_heads], dim=1
        )
        q, k = _rope(qk, cos, sin).split_with_sizes([c.heads, c.kv_heads], dim=1)
        return q, k, v

    def _after_attention(
        self, layer: LayerWeights, h: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor:
        """Return a layer's output: output projection, MLP and both residuals over ``h``."""
        h = h + F.linear(attended, layer.wo)
        gate_up = F.linear(_rms_norm(h, layer.mlp_norm, self.config.rms_eps), layer.w_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, layer.w_down)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project final hidden states ``(T, hidden)`` to float32 logits ``(T, vocab)``."""
        return F.linear(hidden, self.lm_head).float()
