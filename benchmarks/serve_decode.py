"""Decode step of the QuantMLA vLLM backend: the packed cache (C4R4, C2R4) against the same
backend's BF16 mode, as a ratio measured in the same run.

Op level (default; no vLLM needed): the backend's decode call on engine-shaped tensors — block
tables over 16-token pages, a batch of requests at one context, the protection rows — for the
tiny-mla-v2 geometry (d_c 256 + d_r 64, 4 heads) and DeepSeek-V2-Lite's (512 + 64, 16 heads).
The path is the one the backend runs on this device: the vectorized torch path on a CPU, the
Triton kernels on CUDA. Variants alternate within each round (A/B interleaved); the table shows
medians and the ratio to BF16.

Engine level (`--engine EXPORT`, in the serving venv): vLLM itself, `--batch` requests of each
context decoding 32 tokens, BF16 mode vs the export's format; time per decode step after prefill.

    python benchmarks/serve_decode.py [--contexts 1024 2048] [--batch 8] [--rounds 7] [--engine DIR]
        [--out results/bench/serve_decode.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from quantmla.serving.paged_attention import (
    decode_latent,
    decode_latent_rows,
    write_packed,
    write_rows,
)
from quantmla.serving.settings import ServeSettings

GEOMETRIES = {"tiny-mla-v2": (256, 64, 4), "deepseek-v2-lite": (512, 64, 16)}
BLOCK = 16


def op_case(name, context, batch, rounds, reps, device, kernel) -> list[dict]:
    d_c, d_r, heads = GEOMETRIES[name]
    blocks = batch * context // BLOCK
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(blocks * BLOCK, d_c, generator=gen).to(device)
    k = torch.randn(blocks * BLOCK, d_r, generator=gen).to(device)
    slots = torch.arange(blocks * BLOCK, device=device)
    table = torch.randperm(blocks, generator=gen).view(batch, -1).to(device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, d_c, generator=gen).to(device) * 0.1
    qr = torch.randn(batch, heads, d_r, generator=gen).to(device) * 0.1
    rows = torch.zeros(blocks, BLOCK, d_c + d_r, dtype=torch.bfloat16, device=device)
    write_rows(rows, slots, c, k)
    variants = {"bf16": lambda: decode_latent_rows(q, qr, 0.1, table, lens, rows, d_c, kernel)}
    for precision in ("c4r4", "c2r4"):
        layout = ServeSettings(precision=precision).layout(d_c, d_r, BLOCK)
        storage = torch.zeros(blocks, layout.page_bytes(), dtype=torch.uint8, device=device)
        write_packed(storage, layout, slots, c, k, kernel)
        # the engine's protection table: one slot per request, read in place
        prot = torch.randn(batch, 132, d_c + d_r, generator=gen).to(device, torch.bfloat16)
        held = torch.arange(batch, device=device)
        variants[precision] = lambda layout=layout, storage=storage, prot=prot, held=held: (
            decode_latent(q, qr, 0.1, table, lens, layout, storage, prot, held, kernel)
        )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {v: [] for v in variants}
    for fn in variants.values():
        fn()  # warm-up (Triton compile)
    for _ in range(rounds):
        for v, fn in variants.items():
            sync()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            times[v].append((time.perf_counter() - start) / reps * 1e3)
    base = statistics.median(times["bf16"])
    return [
        {
            "level": "op", "geometry": name, "context": context, "batch": batch, "variant": v,
            "median_ms": statistics.median(t), "vs_bf16": statistics.median(t) / base,
        }
        for v, t in times.items()
    ]  # fmt: skip


def engine_case(export, context, batch, steps=32) -> list[dict]:
    """vLLM decode step time, BF16 mode vs the export's own format, one engine at a time."""
    import gc

    from vllm import SamplingParams

    from quantmla.serving.engine import build_llm

    out, base = [], None
    for variant, precision in (("bf16", "bf16"), ("export", None)):
        llm = build_llm(
            export, precision=precision, max_num_seqs=batch, max_model_len=context + steps + 1,
            kv_cache_memory_bytes=2 * batch * (context + steps + 16) * 640 * 6 + 50_000_000,
            enable_log_stats=False,
        )  # fmt: skip
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            ids = [(7 * i + 13 * t) % 4000 + 10 for t in range(context)]
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        engine.step()  # prefill (one step: chunked prefill is off)
        start, n = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        ms = (time.perf_counter() - start) / n * 1e3
        base = base or ms
        out.append({"level": "engine", "geometry": Path(export).name, "context": context,
                    "batch": batch, "variant": variant, "median_ms": ms, "vs_bf16": ms / base})  # fmt: skip
        del llm, engine
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (vLLM's default: 1)")
    parser.add_argument("--engine", default=None, help="also time vLLM on this export")
    parser.add_argument("--out", default="results/bench/serve_decode.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel = "triton" if device == "cuda" else "torch"
    torch.set_num_threads(args.threads)
    rows = []
    for name in GEOMETRIES:
        for context in args.contexts:
            rows += op_case(name, context, args.batch, args.rounds, args.reps, device, kernel)
    if args.engine:
        for context in args.contexts:
            rows += engine_case(args.engine, context, args.batch)
    machine = (
        torch.cuda.get_device_name(0)
        if device == "cuda"
        else f"{platform.processor() or platform.machine()}, {args.threads} thread(s)"
    )
    print(f"machine: {machine}; decode path: {kernel}")
    print(
        f"{'level':<7}{'geometry':<18}{'context':>8}{'batch':>6}{'variant':>9}{'ms':>9}{'x BF16':>8}"
    )
    for r in rows:
        print(
            f"{r['level']:<7}{r['geometry']:<18}{r['context']:>8}{r['batch']:>6}{r['variant']:>9}"
            f"{r['median_ms']:>9.3f}{r['vs_bf16']:>8.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "path": kernel, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
