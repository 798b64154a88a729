"""Drive real vLLM with a :class:`~hicache_storage.integrations.vllm.HiCacheTier`.

These are the pieces the project's vLLM tests use, importable so that a backend author can run
them on their own backend.

- :func:`write_tiny_model`: a tiny Llama (``config.json`` + seeded random ``model.safetensors``)
  that vLLM loads on a CPU without a tokenizer; random weights give outputs that differ per
  prompt, so equal tokens are a strong check.
- :func:`kv_transfer_config`: vLLM's ``--kv-transfer-config`` for a backend as the tier.
- :func:`engine`: a vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  :func:`generate`: greedy tokens and the prompt tokens vLLM reports as cached.
- :func:`prompts`: token prompts sharing a long prefix.

On a CPU-only machine the tier runs behind :class:`~hicache_storage.integrations.vllm.cpu.
CPUTieringSpec` (``cpu_worker=True``, the default where no GPU is visible). Set
``VLLM_CPU_KVCACHE_SPACE`` (GiB) before the first engine; :func:`cpu_environment` does.
A driver script must keep its work under ``if __name__ == "__main__":``: vLLM starts its workers
with ``spawn``, which re-imports the driver.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Generation",
    "cpu_environment",
    "engine",
    "generate",
    "kv_transfer_config",
    "prompts",
    "remove_shared_regions",
    "write_tiny_model",
]

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""4 layers x 2 KV heads x 64 dims: 64 KiB of bf16 KV per 32-token block."""


def cpu_environment(root: Path, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for vLLM on a CPU: a KV space, caches under ``root``, one process per engine."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }


def write_tiny_model(
    directory: Path, *, seed: int = 0, config: Mapping[str, Any] | None = None
) -> Path:
    """Write a model vLLM can load: ``config.json`` and seeded random bf16 weights."""
    from safetensors.torch import save_file

    spec = {**TINY_LLAMA, **(config or {})}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(spec, indent=1))
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    heads, kv_heads, dim = (
        spec["num_attention_heads"],
        spec["num_key_value_heads"],
        spec["head_dim"],
    )
    shapes = {
        "model.embed_tokens.weight": (spec["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    shapes["lm_head.weight"] = (spec["vocab_size"], hidden)
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = 1.0 if "embed" in name else 0.5 / shape[1] ** 0.5 * 4
            weights[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def prompts(
    count: int, prefix_tokens: int, suffix_tokens: int, *, seed: int = 0
) -> list[list[int]]:
    """``count`` prompts sharing one random ``prefix_tokens`` prefix, each with its own suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(prefix_tokens)]
    return [
        prefix + [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(suffix_tokens)]
        for _ in range(count)
    ]


def kv_transfer_config(
    tier: Mapping[str, Any] | None,
    *,
    cpu_bytes: int = 64 << 20,
    cpu_worker: bool | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build vLLM's KV transfer config with ``tier`` as the secondary tier.

    ``tier`` holds our keys (``backend``, ``options`` ...); ``cpu_bytes`` sizes vLLM's primary
    tier, and ``tier=None`` gives the primary tier alone.

    ``cpu_worker`` selects :class:`~hicache_storage.integrations.vllm.cpu.CPUTieringSpec`;
    ``None`` picks it when no GPU is visible.
    """
    if cpu_worker is None:
        cpu_worker = not torch.cuda.is_available()
    spec: dict[str, Any] = (
        {"spec_name": "CPUTieringSpec", "spec_module_path": "hicache_storage.integrations.vllm.cpu"}
        if cpu_worker
        else {"spec_name": "TieringOffloadingSpec"}
    )
    tiers = []
    if tier is not None:
        tiers.append(
            {"type": "HiCacheTier", "module_path": "hicache_storage.integrations.vllm", **tier}
        )
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **spec,
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": tiers,
            **(extra or {}),
        },
    }


@dataclass(frozen=True)
class Generation:
    """One request's greedy tokens and how many prompt tokens vLLM did not compute."""

    tokens: tuple[int, ...]
    cached_tokens: int


@contextlib.contextmanager
def engine(
    model: Path,
    kv_transfer: Mapping[str, Any] | None = None,
    *,
    block_size: int = 32,
    max_model_len: int = 2048,
    tensor_parallel_size: int = 1,
    enable_prefix_caching: bool = False,
    **kwargs: Any,
) -> Iterator[Any]:
    """Start a fresh vLLM ``LLM`` on ``model``; shut it down and free it on exit.

    Eager, without a tokenizer, its GPU-side prefix cache off unless asked for: every prompt
    token a fresh engine does not compute came from the offloading tiers.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    engine_id = f"hicache-{uuid.uuid4().hex[:12]}"
    transfer = None if kv_transfer is None else KVTransferConfig(engine_id=engine_id, **kv_transfer)
    try:
        llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            block_size=block_size,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_transfer_config=transfer,
            seed=0,
            **kwargs,
        )
    except BaseException:
        remove_shared_regions(engine_id)
        raise
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        remove_shared_regions(engine_id)


def generate(
    llm: Any, token_prompts: Sequence[Sequence[int]], max_tokens: int = 8
) -> list[Generation]:
    """Greedy generation of ``max_tokens`` per prompt, one request per prompt, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in token_prompts], params, use_tqdm=False
    )
    return [
        Generation(tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0))
        for out in outputs
    ]


def tiers(llm: Any) -> list[Any]:
    """Return the tiers of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Their ``stats()`` count loads, stores and the backend's errors.
    """
    from hicache_storage.integrations.vllm.tier import HiCacheTier

    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.connector.connector_scheduler.manager
    return [tier for tier in manager.secondary_tiers if isinstance(tier, HiCacheTier)]


def run_detached(
    model: Path,
    kv_transfers: Sequence[Mapping[str, Any] | None],
    token_prompts: Sequence[Sequence[int]],
    *,
    env: Mapping[str, str],
    max_tokens: int = 8,
    timeout: float = 600,
    **engine_kwargs: Any,
) -> subprocess.Popen[str]:
    """Start engines in a process of their own (``python -m`` this module).

    For engines that must run beside others or with several workers
    (``tensor_parallel_size=2``).

    One fresh engine per entry of ``kv_transfers`` (``None``: no offloading), one after another,
    each generating for every prompt; :func:`detached_result` collects their generations.
    """
    with tempfile.NamedTemporaryFile(prefix="hicache-vllm-", suffix=".json", delete=False) as out:
        pass
    job = {
        "out": out.name,
        "model": str(model),
        "kv_transfers": list(kv_transfers),
        "prompts": [list(p) for p in token_prompts],
        "max_tokens": max_tokens,
        "engine": engine_kwargs,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(job))
    process.stdin.close()
    process.job = job  # type: ignore[attr-defined]
    process.timeout = timeout  # type: ignore[attr-defined]
    return process


def detached_result(process: subprocess.Popen[str]) -> list[list[Generation]]:
    """Wait for :func:`run_detached`'s engines; the generations of each, in order.

    Raises
    ------
    RuntimeError
        If the process failed or ran past its timeout (it is killed then).
    """
    out = Path(process.job["out"])  # type: ignore[attr-defined]
    try:
        process.wait(timeout=process.timeout)  # type: ignore[attr-defined]
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        out.unlink(missing_ok=True)
        raise RuntimeError("the detached vLLM engine ran past its timeout") from None
    text = out.read_text()
    out.unlink(missing_ok=True)
    if process.returncode or not text:
        raise RuntimeError(f"the detached vLLM engine failed (exit {process.returncode})")
    rounds = json.loads(text)
    return [[Generation(tuple(g[0]), int(g[1])) for g in gens] for gens in rounds]


def _detached_main() -> None:
    """Run a :func:`run_detached` job from stdin; write the generations where it says."""
    job = json.load(sys.stdin)
    results = []
    for kv_transfer in job["kv_transfers"]:
        with engine(Path(job["model"]), kv_transfer, **job["engine"]) as llm:
            gens = generate(llm, job["prompts"], job["max_tokens"])
        results.append([[list(g.tokens), g.cached_tokens] for g in gens])
    Path(job["out"]).write_text(json.dumps(results))


def remove_shared_regions(engine_id: str) -> None:
    """Remove the primary tier's ``/dev/shm`` files an engine left.

    vLLM unlinks them only when its workers meet at a barrier, which the CPU path has not.
    """
    for path in glob.glob(f"/dev/shm/vllm_offload_{engine_id}*.mmap"):
        with contextlib.suppress(OSError):
            os.unlink(path)


if __name__ == "__main__":
    _detached_main()
