"""A vLLM engine over an export with the QuantMLA backend: the arguments every entry point uses
(tests, the throughput workload, the benchmark, the server), checked before vLLM starts.

`precision="bf16"` is the BF16 mode of the same backend; `None` serves the export's own format.
`kv_cache_memory_bytes` is the whole cache budget: the backend takes the BF16 protection rows
out of it, so a BF16 and a packed engine at the same budget are compared fairly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from quantmla.errors import DataNotFoundError, QuantMLAError
from quantmla.serving.platform import PREFIX_CACHING_REFUSED
from quantmla.serving.settings import (
    ServeSettings,
    check_block_size,
    check_geometry,
    fitting_num_seqs,
    predicted_capacity,
    resolve_settings,
)

# vLLM's CPU rotary custom op is wrong for 3-D multi-head queries in eager mode (NOTES.md):
# use its PyTorch-native rotary instead.
EAGER_COMPILATION = {"custom_ops": ["-rotary_embedding"]}
# On a CPU vLLM needs an explicit KV budget (kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE).
CPU_KV_BYTES = 2 << 30


def model_geometry(model_dir: str | Path) -> dict:
    """d_c, d_r and layers from the export's config.json (no vLLM, no weights)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DataNotFoundError(f"{model_dir}: no config.json (not a Hugging Face checkpoint)")
    config = json.loads(path.read_text())
    return {
        "d_c": config["kv_lora_rank"],
        "d_r": config["qk_rope_head_dim"],
        "layers": config["num_hidden_layers"],
        "max_position_embeddings": config.get("max_position_embeddings"),
    }


def quantmla_config(precision: str | None = None, **fields) -> dict:
    """`additional_config["quantmla"]` for the backend (None: the export's own format)."""
    out = dict(fields)
    if precision is not None:
        out["precision"] = precision
    return out


def check(
    model_dir, quantmla: dict, kv_cache_memory_bytes: int | None, max_num_seqs: int | None,
    block_size: int = 16, max_model_len: int | None = None,
):  # fmt: skip
    """Every refusal the backend would make at start-up, answered before vLLM loads anything;
    returns (settings, geometry). Without `max_num_seqs` (vLLM's default, which the platform
    lowers to what fits) the budget must still hold one `max_model_len`-token request."""
    geometry = model_geometry(model_dir)
    d_c, d_r, layers = geometry["d_c"], geometry["d_r"], geometry["layers"]
    check_geometry(d_c, d_r)
    check_block_size(block_size)
    settings = resolve_settings(model_dir, quantmla)
    if kv_cache_memory_bytes is not None and max_num_seqs is not None:
        predicted_capacity(
            settings, d_c, d_r, layers, block_size, kv_cache_memory_bytes, max_num_seqs
        )
    elif kv_cache_memory_bytes is not None:  # BF16 mode too: one request's pages must fit
        length = max_model_len or geometry["max_position_embeddings"] or block_size
        fitting_num_seqs(settings, d_c, d_r, layers, kv_cache_memory_bytes, length, block_size)
    return settings, geometry


def engine_args(
    model_dir,
    *,
    precision: str | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    dtype: str = "auto",
    seed: int = 0,
    block_size: int = 16,
    quantmla: dict | None = None,
    **extra,
) -> dict:
    """Keyword arguments of `vllm.LLM` / `AsyncEngineArgs` for this export and cache."""
    config = quantmla_config(precision, **(quantmla or {}))
    if kv_cache_memory_bytes is None and _cpu():
        kv_cache_memory_bytes = CPU_KV_BYTES
    check(model_dir, config, kv_cache_memory_bytes, max_num_seqs, block_size, max_model_len)
    args = dict(
        model=str(model_dir),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        additional_config={"quantmla": config},
    )
    if max_num_seqs is not None:  # else vLLM's default, lowered to what the budget protects
        args["max_num_seqs"] = max_num_seqs
    if _cpu():
        args.update(enforce_eager=True, compilation_config=EAGER_COMPILATION)
    else:
        args.update(attention_backend="CUSTOM")
    if extra.get("enable_prefix_caching"):
        raise QuantMLAError(PREFIX_CACHING_REFUSED)
    args.update(extra)
    return args


def alias_vllm_distribution() -> None:
    """Let code that asks for the distribution "vllm" (lm-eval, vLLM's own CLI) find the CPU
    build, "vllm-cpu", whose version vLLM itself reads as "<version>+cpu"."""
    import importlib.metadata

    real = importlib.metadata.version
    try:
        real("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        cpu = real("vllm-cpu") + "+cpu"

    def version(name: str) -> str:
        return cpu if name == "vllm" else real(name)

    importlib.metadata.version = version


def build_llm(model_dir, **kwargs):
    """An offline `vllm.LLM` in this process (so tests and workloads can read its scheduler)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(**engine_args(model_dir, **kwargs))


def capacity_tokens(llm) -> int:
    """Tokens the engine's KV cache holds (vLLM's own block count × block size)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


def expected_capacity(
    model_dir, settings: ServeSettings, kv_bytes: int, max_num_seqs: int, block_size: int = 16
) -> int:
    """The memory model's token capacity for this export at an explicit budget."""
    g = model_geometry(model_dir)
    return predicted_capacity(
        settings, g["d_c"], g["d_r"], g["layers"], block_size, kv_bytes, max_num_seqs
    )


def _cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
