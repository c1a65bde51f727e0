"""One decode step through the simulated cache: C4R4 (each token quantized once as it enters the
cache) against the same patched model at BF16, and against re-quantizing the whole history every
step (the simulator before the incremental cache), in the same run.

Model: random-init DeepSeek-V2-Lite dims (d_c 512, d_r 64, 16 heads, nope 128, v 128, hidden
2048, YaRN), 2 layers, fp32. The cache is filled with `context` tokens of a real prefill's
statistics (the model's own c and k_R for random ids, tiled), then one token is decoded; the
first step after filling builds the dequantized copy and is not timed. Median of `--repeats`
steps (each appends one token). Also: cache bytes held (raw + dequantized copy) vs the unquantized cache.

    python benchmarks/decode_step.py [--contexts 4096 16384] [--threads 1] [--repeats 9] [--out results/bench/decode_step.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "assets" / "model-configs" / "deepseek-v2-lite.json"
VARIANTS = ("bf16", "c4r4", "c4r4-requantize")


def filled_cache(model, context: int):
    """A DynamicCache holding `context` tokens: one short real prefill, tiled to the length."""
    from transformers import DynamicCache

    probe = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 1000, (1, 256)), past_key_values=probe, use_cache=True)
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(probe.layers):
        reps = -(-context // layer.keys.shape[-2])
        c = layer.keys.repeat(1, 1, reps, 1)[..., :context, :]
        k = layer.values.repeat(1, 1, reps, 1)[..., :context, :]
        cache.update(c.contiguous(), k.contiguous(), i)
    return cache


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "keys_hat", "values_hat"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def measure(model, variant: str, context: int, repeats: int) -> dict:
    from quantmla import set_policy

    precision = "bf16" if variant == "bf16" else "c4r4"
    set_policy(model, precision=precision, incremental=variant != "c4r4-requantize")
    cache = filled_cache(model, context)
    token = torch.randint(0, 1000, (1, 1))
    times = []
    with torch.no_grad():
        for step in range(repeats + 1):
            start = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            if step:  # the first step builds the dequantized copy of the filled history
                times.append(time.perf_counter() - start)
    return {
        "variant": variant,
        "context": context,
        "step_ms": 1000 * statistics.median(times),
        "cache_bytes": cache_bytes(cache),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "decode_step.json"))
    args = parser.parse_args()
    from quantmla import patch_model
    from quantmla.models.loading import random_model_from_config_file

    torch.set_num_threads(args.threads)
    model = random_model_from_config_file(
        CONFIG, num_layers=2, vocab_size=1000, n_experts=8, ffn_size=256, max_heads=16
    )
    patch_model(model, "bf16", sink=4, recent=128, form="absorbed")
    rows = [measure(model, v, n, args.repeats) for n in args.contexts for v in VARIANTS]
    base = {r["context"]: r for r in rows if r["variant"] == "bf16"}
    print(
        f"decode step, DeepSeek-V2-Lite dims, 2 layers, fp32, {args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    print("| context | variant | step ms | × bf16 step | cache bytes / unquantized latent cache |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["vs_bf16"] = r["step_ms"] / base[r["context"]]["step_ms"]
        r["memory_vs_unquantized"] = r["cache_bytes"] / base[r["context"]]["cache_bytes"]
        print(
            f"| {r['context']} | {r['variant']} | {r['step_ms']:.1f} | {r['vs_bf16']:.2f} | {r['memory_vs_unquantized']:.2f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": platform.platform(), "threads": args.threads, "rows": rows}, indent=1
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
