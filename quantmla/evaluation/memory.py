"""The memory evaluator (Fig. 5a): persistent cache bytes per layer and request of the packed
layout, for the job's precision and the model's own d_c and d_r (analytic, no weights loaded)."""

from __future__ import annotations

from quantmla.memory import CacheLayout

DEFAULT_LENGTHS = [2**k for k in range(10, 21)]


def evaluate(cfg, prepared) -> dict:
    config, policy = prepared.model_config, prepared.policy
    dims = {"d_c": config.kv_lora_rank, "d_r": config.qk_rope_head_dim}
    quantized = CacheLayout(policy.spec, **dims, sink=policy.sink, recent=policy.recent)
    bf16 = CacheLayout(type(policy.spec).from_precision("bf16"), **dims)
    metrics = {
        "memory/d_c": dims["d_c"],
        "memory/d_r": dims["d_r"],
        "memory/page_bytes": quantized.page_bytes(),
        "memory/token_bytes": quantized.token_bytes(),
    }
    for n in cfg.eval.context_lengths or DEFAULT_LENGTHS:
        metrics[f"memory/bytes@{n}"] = quantized.persistent_bytes(n)
        metrics[f"memory/compression@{n}"] = bf16.persistent_bytes(n) / quantized.persistent_bytes(
            n
        )
    return metrics


def format_table(record: dict) -> str:
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.6g} |" for k, v in record["metrics"].items()]
    return "\n".join(lines)
