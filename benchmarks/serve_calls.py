"""Where a served step's time goes: the QuantMLA backend's calls timed inside vLLM, BF16 mode
against an export's format, in interleaved pairs (serving venv; vLLM's engine in this process).

Each pair runs `quantmla.serving.throughput` twice (BF16 mode, then the export's format) with the
backend's methods and helpers wrapped by timers: prefill (`forward_mha`) and within it the
context read, the exact copies' window pass, the fused attention passes and the dequantize;
decode (`forward_mqa`) and its kernel; the writer (`do_kv_cache_update`); the protection table's
bookkeeping. Prints seconds and calls per timer and pair, writes JSON.

    python benchmarks/serve_calls.py --model EXPORT --text TEXT [--pairs 2] [--chunk 256]
        [--budget 78000000] [--first-chunk-admission] [--dtype float32] [--out results/bench/serve_calls.json]

The tiny Fig. 5c twin's cell: EXPORT from `python -m quantmla.export model=tiny_mla_v2_4k
method=rtn precision=c4r4 out=DIR`, TEXT the WikiText-2 test text (5 prompts of 3,968 tokens).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import time
from pathlib import Path

TIMERS = {  # timer name: (module, attribute path)
    "prefill": ("quantmla.serving.backend", "QuantMLAImpl.forward_mha"),
    "prefill/context": ("quantmla.serving.backend", "QuantMLAImpl._context"),
    "prefill/attention": ("quantmla.serving.backend", "prefill_attention"),
    "prefill/attention/fused passes": ("quantmla.attention", "attend"),
    "prefill/attention/window pass": ("quantmla.attention", "merge_window"),
    "prefill/attention/dequantize": ("quantmla_kernels.paged_cache.ops", "dequantize"),
    "decode": ("quantmla.serving.backend", "QuantMLAImpl.forward_mqa"),
    "decode/kernel": ("quantmla.serving.backend", "decode_latent"),
    "decode/kernel (BF16 rows)": ("quantmla.serving.backend", "decode_latent_rows"),
    "writer": ("quantmla.serving.backend", "QuantMLAImpl.do_kv_cache_update"),
    "protection/assign": ("quantmla.serving.protection", "ProtectionTable.assign"),
    "protection/write": ("quantmla.serving.protection", "ProtectionTable.write"),
    "protection/write_next": ("quantmla.serving.protection", "ProtectionTable.write_next"),
    "protection/held": ("quantmla.serving.protection", "ProtectionTable.held"),
}


def install_timers(seconds: dict, calls: dict) -> None:
    """Wrap every TIMERS target once; each call adds its wall time to `seconds[name]`."""
    import importlib

    for name, (module, path) in TIMERS.items():
        owner = importlib.import_module(module)
        *parents, attribute = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        inner = getattr(owner, attribute)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start
                calls[_name] += 1

        setattr(owner, attribute, timed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="an export (python -m quantmla.export)")
    parser.add_argument("--text", required=True, help="text the prompts are cut from")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--budget", type=int, default=78_000_000, help="KV cache bytes")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--input-tokens", type=int, default=3968)
    parser.add_argument("--output-tokens", type=int, default=31)
    parser.add_argument("--first-chunk-admission", action="store_true")
    parser.add_argument(
        "--dtype", default="float32", help="the model's dtype (the twin's job serves float32)"
    )
    parser.add_argument("--out", default="results/bench/serve_calls.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

    from quantmla.serving.throughput import main as serve

    seconds, calls = collections.defaultdict(float), collections.Counter()
    install_timers(seconds, calls)
    base = [
        "--model", args.model, "--text", args.text, "--requests", str(args.requests),
        "--input-tokens", str(args.input_tokens), "--output-tokens", str(args.output_tokens),
        "--kv-cache-memory-bytes", str(args.budget), "--max-num-seqs", str(args.requests),
        "--max-num-batched-tokens", str(args.chunk), "--dtype", args.dtype,
        *(["--first-chunk-admission"] if args.first_chunk_admission else []),
    ]  # fmt: skip
    runs = []
    for pair in range(args.pairs):
        for mode, extra in (("bf16", ["--precision", "bf16"]), ("export", [])):
            seconds.clear()
            calls.clear()
            metrics = serve(base + extra)
            runs.append({
                "pair": pair, "mode": mode, "wall_s": metrics["wall_s"],
                "output_tok_s": metrics["output_tok_s"],
                "timers": {k: {"s": seconds[k], "calls": calls[k]} for k in sorted(seconds)},
            })  # fmt: skip
            print(f"pair {pair} {mode:6s} wall {metrics['wall_s']:.2f} s, "
                  f"{metrics['output_tok_s']:.2f} output tok/s")  # fmt: skip
            for k in sorted(seconds):
                print(f"    {k:34s} {seconds[k]:8.3f} s {calls[k]:7d} calls")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(),
                               "args": vars(args), "runs": runs}, indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
