"""Fig. 5c's mechanism at GPU scale without downloading a checkpoint: a random-init model with
DeepSeek-V2-Lite's published MLA dims (d_c 512, d_r 64, 16 heads; layers and experts shrunk),
served by vLLM with the QuantMLA backend, BF16 mode vs C4R4 (RTN) at one KV budget sized so that
BF16 must preempt; vLLM's own counters, one JSON. Needs vLLM (the serving venv).

    python benchmarks/serve_throughput.py --quick          # one GPU, < 8 min: 5 x (16K in, 512 out)
    python benchmarks/serve_throughput.py --input-tokens 131072 --output-tokens 1024 --tensor-parallel 8
        [--out results/bench/serve_throughput.json]

The budget: BF16 pages for `--fit` prompts plus one request's output, so vLLM admits that many
prompts in BF16 and must preempt as they grow; C4R4 (3.6x smaller pages at 512 + 64, minus the BF16
protection rows) holds every request at its full length. Random weights make
the text meaningless but the cache traffic, scheduling and preemptions real.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "assets" / "model-configs" / "deepseek-v2-lite.json"


def random_export(folder: Path, layers: int) -> Path:
    """A shrunk random-init V2-Lite checkpoint (real MLA dims), lm_head written untied."""
    import torch

    from quantmla.models.loading import random_model_from_config_file

    model = random_model_from_config_file(
        CONFIG, num_layers=layers, vocab_size=102400, n_experts=8, ffn_size=1408, max_heads=16
    ).to(torch.bfloat16)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 x (16K in, 512 out), 4 layers")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--input-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument(
        "--fit", type=float, default=2.5, help="BF16 holds about this many requests"
    )
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--out", default="results/bench/serve_throughput.json")
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.exit("error: needs vLLM: run it with the serving venv's python (make serve-setup)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from quantmla.serving.engine import build_llm
    from quantmla.serving.throughput import run_workload

    n_in = args.input_tokens or (16384 if args.quick else 131072)
    n_out = args.output_tokens or (512 if args.quick else 1024)
    layers = args.layers or (4 if args.quick else 27)
    bf16_token = (512 + 64) * 2 * layers
    budget = (args.fit * n_in + n_out) * bf16_token
    prompts = [[(7 * r + 31 * t) % 100000 + 100 for t in range(n_in)] for r in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        export = random_export(Path(tmp), layers)
        for precision in ("bf16", "c4r4"):
            llm = build_llm(
                export, precision=precision, kv_cache_memory_bytes=budget,
                max_num_seqs=args.requests, max_model_len=n_in + n_out, dtype="bfloat16",
                tensor_parallel_size=args.tensor_parallel, skip_tokenizer_init=True,
                disable_log_stats=False,
            )  # fmt: skip
            metrics = run_workload(llm, prompts, n_out)
            rows.append({"precision": precision, "kv_budget_bytes": budget, **metrics})
            print(json.dumps(rows[-1]), flush=True)
            del llm
            gc.collect()
    import torch

    machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    bf16, c4r4 = rows
    print(f"machine: {machine}; layers {layers}; {args.requests} x ({n_in} in, {n_out} out)")
    for key in ("kv_capacity_tokens", "running_max", "preemptions", "engine_steps", "output_tok_s"):
        print(f"{key:<20}{bf16[key]:>14,.2f}{c4r4[key]:>14,.2f}")
    print(f"output tok/s ratio C4R4 / BF16: {c4r4['output_tok_s'] / bf16['output_tok_s']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "layers": layers, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
