"""eval.kind=latency (Fig. 5b): decode-step latency of the packed cache (C4R4 and C2R4) against
the BF16 kernel of the same structure and the other baselines, measured in the same job
(kernels/paged_cache/latency.py; protocol in benchmarks/decode_latency.py). Needs a CUDA device:
speed is never measured on a CPU (there, `python benchmarks/decode_latency.py` checks function)."""

from __future__ import annotations

from quantmla.errors import QuantMLAError

BATCHES = (8, 32)  # the paper's


def evaluate(cfg, prepared) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise QuantMLAError(
            "eval.kind=latency measures speed and needs a CUDA device; on a CPU, "
            "`python benchmarks/decode_latency.py` checks the kernels' function instead"
        )
    from quantmla.evaluation.latency_harness import (
        measured_copy_bandwidth,
        run_case,
        spec_bandwidth,
    )

    heads = prepared.model_config.num_attention_heads
    name = torch.cuda.get_device_name(0)
    spec, copy = spec_bandwidth(name), measured_copy_bandwidth()
    metrics: dict = {
        "latency/device": name,
        "latency/heads": heads,
        "latency/hbm_copy_gbps": copy / 1e9,
    }
    for batch in BATCHES:
        for context in cfg.eval.context_lengths:
            for row in run_case(batch, context, heads, rounds=5, reps=100):
                key = f"{row['variant']}/b{batch}/{context}"
                metrics[f"latency/{key}"] = row["graph"]["median_ms"]
                metrics[f"latency_p20/{key}"] = row["graph"]["p20_ms"]
                metrics[f"latency_p80/{key}"] = row["graph"]["p80_ms"]
                metrics[f"latency_cold/{key}"] = row["cold_l2"]["median_ms"]
                metrics[f"vs_bf16/{key}"] = row["vs_bf16"]
                metrics[f"gbps/{key}"] = row["gbps"]
                if spec:
                    metrics[f"hbm_fraction/{key}"] = row["gbps"] * 1e9 / spec
                if row["writer_fraction"] is not None:
                    metrics[f"writer_fraction/{key}"] = row["writer_fraction"]
    return metrics


def format_table(record: dict) -> str:
    m = record["metrics"]
    lines = [f"{'variant/batch/context':<32}{'ms':>10}{'×bf16':>8}{'GB/s':>9}"]
    for key in sorted(
        k.removeprefix("latency/") for k in m if k.startswith("latency/") and k.count("/") == 3
    ):
        lines.append(
            f"{key:<32}{m[f'latency/{key}']:>10.3f}{m[f'vs_bf16/{key}']:>8.3f}{m[f'gbps/{key}']:>9.0f}"
        )
    return "\n".join(lines)
