"""Chunked prefill of the QuantMLA vLLM backend: the packed cache (C4R4) against the same backend's
BF16 mode, per prompt token, as a ratio measured in the same run (issue #42 item 2).

Op level, no vLLM: one request's prompt prefilled chunk by chunk as the backend does it — each
chunk attends over itself, the context's protection rows and the context's cache copy
(`prefill_attention` with a `PrefillContext` read through `context_reader` / `row_reader`, the
backend's own readers), then is written to the cache (`write_packed` / `write_rows`, and the
protection rows). Geometry: the Fig. 5c twin's model (tiny-mla-v2-4k: d_c 256 + d_r 64, 4 heads,
d_nope 64, d_v 64; served in float32 as its config says), 16-token pages, a 3,968-token prompt,
chunks of 256 and 2,048. Variants
alternate within each round; the table shows medians, the ratio to BF16 mode, and (`--profile`)
where each variant's time goes. Beside the times, the arithmetic each variant does per prompt
(counted from the calls the backend makes: rows expanded through `kv_b_proj`, (query, key) pairs
scored by the fused passes and by the window pass), and the ratio it alone would set: C4R4's
time / BF16 mode's time cannot fall below it unless a pass gets cheaper per pair or row.

    python benchmarks/serve_prefill.py [--prompt 3968] [--chunks 256 2048] [--rounds 5]
        [--threads N] [--dtype float32] [--profile] [--out results/bench/serve_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import quantmla.attention as mla_attention
from quantmla.attention import PrefillContext, prefill_attention
from quantmla.serving.paged_attention import (
    context_reader,
    row_reader,
    write_packed,
    write_rows,
)
from quantmla.serving.settings import ServeSettings

D_C, D_R, HEADS, D_NOPE, D_V = 256, 64, 4, 64, 64
BLOCK = 16
SINK, RECENT = 4, 128


class Request:
    """One request's engine state: its pages (a block table over a page store) and, quantized,
    its protection rows (the sinks and the last `recent` tokens, by position)."""

    def __init__(self, precision: str, tokens: int):
        settings = ServeSettings(precision=precision)
        self.spec, self.quantized = settings.spec, settings.quantized
        blocks = -(-tokens // BLOCK)
        self.table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
        self.layout = settings.layout(D_C, D_R, BLOCK)
        if self.quantized:
            self.store = torch.zeros(blocks, self.layout.page_bytes(), dtype=torch.uint8)
        else:
            self.store = torch.zeros(blocks, BLOCK, D_C + D_R, dtype=torch.bfloat16)
        self.workspace = torch.empty(tokens + 2 * BLOCK, D_C + D_R)  # vLLM's: ≥ the context
        self.rows = torch.empty(0, D_C + D_R, dtype=torch.bfloat16)  # exact rows, by position

    def context(self, tokens: int, n: int) -> PrefillContext | None:
        """The context of an n-token chunk as the backend builds it, read in one piece (vLLM's
        workspace holds it); packed, the pages hold the chunk too (written before attending)."""
        if not self.quantized:
            if tokens == 0:
                return None
            read = row_reader(self.store, self.table, D_C)
            return PrefillContext(tokens, torch.empty(0), torch.empty(0, D_C + D_R), read, tokens)
        sinks = torch.arange(min(SINK, tokens))
        positions = torch.cat(
            [sinks, torch.arange(min(tokens, max(SINK, tokens - RECENT)), tokens)]
        )
        read = context_reader(self.store, self.layout, self.table, self.workspace, "torch")
        return PrefillContext(tokens, positions, self.rows[positions], read, tokens + n, True)

    def write(self, start: int, c: torch.Tensor, k_r: torch.Tensor) -> None:
        n = c.shape[0]
        slots = (
            self.table[(start + torch.arange(n)) // BLOCK] * BLOCK
            + (start + torch.arange(n)) % BLOCK
        )
        if self.quantized:
            write_packed(self.store, self.layout, slots, c, k_r, "torch")
            self.rows = torch.cat([self.rows, torch.cat([c, k_r], -1).to(torch.bfloat16)])
        else:
            write_rows(self.store, slots, c, k_r)


def prefill(precision: str, inputs, prompt: int, chunk: int) -> None:
    """The whole prompt through the backend's chunked prefill, as one engine request."""
    q, c, k_r, kv_b_proj = inputs
    request = Request(precision, prompt)
    for start in range(0, prompt, chunk):
        end = min(prompt, start + chunk)
        request.write(start, c[start:end], k_r[start:end])  # vLLM writes a step's tokens first
        prefill_attention(
            q[start:end], c[start:end], k_r[start:end], kv_b_proj, request.spec, SINK, RECENT,
            D_NOPE, D_V, 0.1, context=request.context(start, end - start),
        )  # fmt: skip


def arithmetic(precision: str, inputs, prompt: int, chunk: int) -> dict:
    """What one prompt's prefill computes, counted by wrapping the backend's passes: rows through
    `kv_b_proj`; (query, key) pairs of the fused passes (causal: query r reads keys 0 .. r) and
    of the window pass (as its C++ op computes them: per block of 64 queries, the band's span of
    keys for every query, and every sink); FLOPs at 2 · heads · (d_nope + d_r + d_v) per pair and
    2 · d_c · heads · (d_nope + d_v) per expanded row."""
    count = {"expanded_rows": 0, "fused_pairs": 0, "window_pairs": 0, "window_pairs_read": 0}
    q, c, k_r, kv_b_proj = inputs
    attend, merge_window = mla_attention.attend, mla_attention.merge_window

    def counted_proj(x):
        count["expanded_rows"] += x.shape[0]
        return kv_b_proj(x)

    def counted_attend(qh, keys, values, mask, scaling, causal=False):
        n, m = qh.shape[1], keys.shape[1]
        count["fused_pairs"] += sum(min(r + 1, m) for r in range(n)) if causal else n * m
        return attend(qh, keys, values, mask, scaling, causal=causal)

    def counted_window(qh, keys, values, j, start, sink, recent, scaling, out, lse):
        sinks = sum(p < sink for p in j)
        base, banded, n = (j[sinks] if sinks < len(j) else start), len(j) - sinks, qh.shape[1]
        for r0 in range(0, n, 64):
            rows, i0 = min(64, n - r0), start + r0
            lo, hi = max(base, i0 - recent + 1), min(base + banded - 1, i0 + rows - 1)
            count["window_pairs"] += rows * (max(0, hi - lo + 1) + sinks)
        for r in range(n):
            i = start + r
            band = min(i, base + banded - 1) - max(base, i - recent + 1) + 1
            count["window_pairs_read"] += max(0, band) + sum(p <= i for p in j[:sinks])
        merge_window(qh, keys, values, j, start, sink, recent, scaling, out, lse)

    mla_attention.attend, mla_attention.merge_window = counted_attend, counted_window
    try:
        prefill(precision, (q, c, k_r, counted_proj), prompt, chunk)
    finally:
        mla_attention.attend, mla_attention.merge_window = attend, merge_window
    pair = 2 * HEADS * (D_NOPE + D_R + D_V)
    count["gflop"] = (
        count["expanded_rows"] * 2 * D_C * HEADS * (D_NOPE + D_V)
        + (count["fused_pairs"] + count["window_pairs"]) * pair
    ) / 1e9
    return count


def profile_difference(inputs, prompt: int, chunk: int, rounds: int = 3, top: int = 12) -> dict:
    """Where C4R4's extra time goes: each operator's self CPU time per prompt (torch profiler,
    mean of `rounds`) in both modes, printed by C4R4 − BF16, largest first."""
    from torch.profiler import profile

    ms = {}
    for precision in ("bf16", "c4r4"):
        with profile() as prof:
            for _ in range(rounds):
                prefill(precision, inputs, prompt, chunk)
        ms[precision] = {e.key: e.self_cpu_time_total / 1e3 / rounds for e in prof.key_averages()}
    names = sorted(set(ms["bf16"]) | set(ms["c4r4"]),
                   key=lambda k: ms["bf16"].get(k, 0.0) - ms["c4r4"].get(k, 0.0))  # fmt: skip
    total = {p: sum(t.values()) for p, t in ms.items()}
    print(f"chunks of {chunk}: self CPU ms per prompt, BF16 {total['bf16']:.0f}, "
          f"C4R4 {total['c4r4']:.0f} (profiled; the profiler adds its own time)")  # fmt: skip
    print(f"{'operator':<52}{'BF16':>8}{'C4R4':>8}{'extra':>8}")
    for k in names[:top]:
        b, c = ms["bf16"].get(k, 0.0), ms["c4r4"].get(k, 0.0)
        print(f"{k[:51]:<52}{b:>8.1f}{c:>8.1f}{c - b:>8.1f}")
    return {
        "chunk": chunk,
        "total": total,
        "operators": {k: {p: ms[p].get(k, 0.0) for p in ms} for k in names[:top]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=3968)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads (default: all cores, as vLLM's CPU worker binds one per core)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--profile", action="store_true", help="where each variant's time goes")
    parser.add_argument("--out", default="results/bench/serve_prefill.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    n, dtype = args.prompt, getattr(torch, args.dtype)
    proj = torch.nn.Linear(D_C, HEADS * (D_NOPE + D_V), bias=False).to(dtype)
    torch.nn.init.normal_(proj.weight, std=D_C**-0.5, generator=gen)
    inputs = (
        torch.randn(n, HEADS, D_NOPE + D_R, generator=gen).to(dtype),
        torch.randn(n, D_C, generator=gen).to(dtype),
        torch.randn(n, D_R, generator=gen).to(dtype),
        lambda x: proj(x.to(dtype)),
    )
    rows, profiles = [], []
    with torch.no_grad():
        for chunk in args.chunks:
            times = {"bf16": [], "c4r4": []}
            for precision in times:
                prefill(precision, inputs, n, chunk)  # warm-up (the C++ op builds once)
            for _ in range(args.rounds):
                for precision in times:
                    start = time.perf_counter()
                    prefill(precision, inputs, n, chunk)
                    times[precision].append((time.perf_counter() - start) / n * 1e6)
            base = statistics.median(times["bf16"])
            work = {v: arithmetic(v, inputs, n, chunk) for v in times}
            rows += [{"prompt": n, "chunk": chunk, "variant": v, "us_per_token": statistics.median(t),
                      "min": min(t), "max": max(t), "vs_bf16": statistics.median(t) / base,
                      **work[v], "gflop_vs_bf16": work[v]["gflop"] / work["bf16"]["gflop"]}
                     for v, t in times.items()]  # fmt: skip
            if args.profile:
                profiles.append(profile_difference(inputs, n, chunk))
    machine = (
        f"{platform.processor() or platform.machine()}, {args.threads} thread(s), {args.dtype}"
    )
    print(f"machine: {machine}; prefill path: torch (the backend's CPU path)")
    print(f"{'prompt':>7}{'chunk':>7}{'variant':>9}{'us/token':>10}{'min':>9}{'max':>9}"
          f"{'x BF16':>8}{'rows':>8}{'pairs (M)':>11}{'GFLOP':>7}{'x BF16':>8}")  # fmt: skip
    for r in rows:
        pairs = (r["fused_pairs"] + r["window_pairs"]) / 1e6
        print(f"{r['prompt']:>7}{r['chunk']:>7}{r['variant']:>9}{r['us_per_token']:>10.1f}"
              f"{r['min']:>9.1f}{r['max']:>9.1f}{r['vs_bf16']:>8.2f}{r['expanded_rows']:>8}"
              f"{pairs:>11.2f}{r['gflop']:>7.2f}{r['gflop_vs_bf16']:>8.2f}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "rows": rows}
    if profiles:
        record["profile_ms_per_prompt"] = profiles
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
