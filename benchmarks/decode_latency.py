"""Fig. 5b: decode-attention latency of the packed cache (C4R4, C2R4) against BF16, per step.

One decode step = the split-K kernel over every request's pages + the protected rows + the LSE
merge. Baselines, all in the same run and interleaved with the packed kernel (A/B rounds):
  bf16        the same Triton kernel over a BF16 paged cache (the primary ratio),
  dequant     dequantize every packed page into a BF16 workspace, then the BF16 kernel,
  flashmla    FlashMLA's BF16 decode, when `flash_mla` imports.
Protocol: each variant's launch config (BLOCK_H, num_warps) tuned first on the same shapes; then
`--rounds` interleaved rounds of cold-L2 timing (`triton.testing.do_bench`, which flushes L2
before every repetition) and CUDA-graph replay timing (events around each replay); median and
p20/p80 over ≥ 100 repetitions per variant. Each point records the bytes one step reads (codes,
metadata, protection rows, page tables, queries, split partials), achieved GB/s and the fraction
of the device's HBM bandwidth (spec sheet where known, and a measured device-to-device copy).
Also the writer: packing one token per request, as a fraction of the decode step.

    python benchmarks/decode_latency.py --quick          # < 8 min on one H200/H100
    python benchmarks/decode_latency.py                   # batch 8, 32; 1K-1M; h_q 16, 128
    python -m analysis.figures fig5b --bench results/bench/decode_latency.json

Without CUDA it checks the kernels' function against the references at small sizes (Triton's
interpreter) and says so: no speed is measured on a CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from quantmla.evaluation.latency_harness import (
    PRESETS,
    function_check,
    measured_copy_bandwidth,
    run_case,
    spec_bandwidth,
)

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 contexts (4K, 32K, 128K): < 8 min")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--reps", type=int, default=100, help="repetitions per variant and timing mode"
    )
    parser.add_argument("--out", default=str(REPO / "results" / "bench" / "decode_latency.json"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        checks = function_check()
        print("no CUDA device: measured FUNCTION, not speed (Triton interpreter vs references)")
        for precision, c in checks.items():
            print(
                f"  {precision}: max |o - ref| {c['max_abs_err']:.2e}, |lse - ref| {c['lse_err']:.2e}"
            )
        out.write_text(
            json.dumps(
                {"measured": "function", "machine": platform.platform(), "checks": checks}, indent=2
            )
        )
        print(f"wrote {out}")
        return
    preset = PRESETS["quick" if args.quick else "full"]
    name = torch.cuda.get_device_name(0)
    spec, copy = spec_bandwidth(name), measured_copy_bandwidth()
    rows = []
    started = time.time()
    for heads in preset["heads"]:
        for batch in preset["batches"]:
            for context in preset["contexts"]:
                case = run_case(batch, context, heads, args.rounds, args.reps)
                for r in case:
                    r["hbm_fraction_spec"] = r["gbps"] * 1e9 / spec if spec else None
                    r["hbm_fraction_copy"] = r["gbps"] * 1e9 / copy
                rows += case
                for r in case:
                    print(
                        f"h{heads:<4} b{batch:<3} {context:>8}  {r['variant']:<14} graph {r['graph']['median_ms']:8.3f} ms "
                        f"[{r['graph']['p20_ms']:.3f}, {r['graph']['p80_ms']:.3f}]  cold {r['cold_l2']['median_ms']:8.3f} ms  "
                        f"{r['gbps']:7.0f} GB/s  ×bf16 {r['vs_bf16']:.3f}"
                        + (
                            f"  writer {100 * r['writer_fraction']:.1f}%"
                            if r["writer_fraction"]
                            else ""
                        ),
                        flush=True,
                    )
                out.write_text(
                    json.dumps(
                        {
                            "measured": "speed",
                            "device": name,
                            "hbm_spec_bytes_per_s": spec,
                            "hbm_copy_bytes_per_s": copy,
                            "torch": torch.__version__,
                            "preset": "quick" if args.quick else "full",
                            "seconds": time.time() - started,
                            "rows": rows,
                        },
                        indent=2,
                    )
                )
    print(f"wrote {out} ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
