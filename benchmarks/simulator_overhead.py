"""Cost of the cache simulator against the unpatched transformers model, in the same run.

Model: random-init DeepSeek-V2-Lite shape (real MLA dims: d_c 512, d_r 64, 16 heads, nope 128,
v 128, hidden 2048, YaRN), 2 layers (one dense, one MoE with 64 experts), the real 102,400 vocab.
Variants: unpatched | patched bf16 | patched c4r4 with protection (sink 4, recent 128).
Each (variant, length) runs in a fresh subprocess so peak memory is its own: on CPU the peak RSS
increase over the loaded model, on CUDA `max_memory_allocated` minus the model.

    python benchmarks/simulator_overhead.py [--lengths 512 2048] [--repeats 3] [--out results/bench/simulator_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "assets" / "model-configs" / "deepseek-v2-lite.json"
VARIANTS = ("unpatched", "bf16", "c4r4")


def measure(variant: str, length: int, repeats: int, device: str) -> dict:
    from quantmla import patch_model
    from quantmla.models.loading import random_model_from_config_file

    model = random_model_from_config_file(
        CONFIG, num_layers=2, vocab_size=102400, n_experts=64, ffn_size=1408, max_heads=16
    ).to(device)
    if variant != "unpatched":
        patch_model(model, variant, sink=4, recent=128)
    x = torch.randint(0, 102400, (1, length), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    times = []
    with torch.no_grad():
        model(x)  # warm-up
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            model(x)
            sync()
            times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated() - base_cuda
        if device == "cuda"
        else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024
    )
    return {"variant": variant, "tokens": length, "seconds": min(times), "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out", default=str(REPO / "results" / "bench" / "simulator_overhead.json")
    )
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.repeats, args.device)))
        return

    rows = []
    for length in args.lengths:
        for variant in VARIANTS:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    variant,
                    str(length),
                    "--repeats",
                    str(args.repeats),
                    "--device",
                    args.device,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = {r["tokens"]: r for r in rows if r["variant"] == "unpatched"}
    print(
        f"machine: {platform.node()} ({os.cpu_count()} CPUs, device {args.device}, torch {torch.__version__})"
    )
    print("| tokens | variant | forward s | × unpatched | peak MiB | × unpatched |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = base[r["tokens"]]
        r["time_ratio"] = r["seconds"] / b["seconds"]
        r["memory_ratio"] = r["peak_bytes"] / max(b["peak_bytes"], 1)
        print(
            f"| {r['tokens']} | {r['variant']} | {r['seconds']:.3f} | {r['time_ratio']:.2f} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {r['memory_ratio']:.2f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"machine": platform.node(), "device": args.device, "rows": rows}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
