"""Fig. 5c's workload under vLLM's own scheduler: N requests of `input_tokens` prompt tokens and
`output_tokens` greedy tokens, all submitted at once, at a fixed KV budget, BF16 mode vs the
export's packed cache. Run in the serving venv:

    python -m quantmla.serving.throughput --model DIR [--precision bf16] --json OUT

Each step of the engine is driven here so the record holds vLLM's own numbers per step: KV
token capacity, running requests (max and mean over steps), preemptions, engine steps, output
tokens per second and wall time. Prompts are consecutive WikiText-2 test tokens (one offset per
request), so no two requests share a prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from quantmla.errors import DataNotFoundError


def workload_prompts(
    tokenizer, text_file: Path, requests: int, input_tokens: int
) -> list[list[int]]:
    """`requests` prompts of exactly `input_tokens` tokens, each from its own offset in the text."""
    if not Path(text_file).is_file():
        raise DataNotFoundError(f"{text_file}: the workload's text is missing")
    ids = tokenizer(Path(text_file).read_text()).input_ids
    need = input_tokens + (requests - 1) * 997  # distinct, overlapping windows
    while len(ids) < need:
        ids = ids + ids
    return [ids[i * 997 : i * 997 + input_tokens] for i in range(requests)]


def _metric(llm, name: str) -> float:
    for m in llm.get_metrics():
        if m.name == name:
            return float(getattr(m, "value", 0) or 0)
    return 0.0


def run_workload(llm, prompts: list[list[int]], output_tokens: int, progress: bool = True) -> dict:
    """Submit every request, step the engine until all finish; vLLM's own counters."""
    from vllm import SamplingParams

    from quantmla.serving.engine import capacity_tokens

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    preempted_before = _metric(llm, "vllm:num_preemptions")
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    running, steps, generated = [], 0, 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        running.append(_metric(llm, "vllm:num_requests_running"))
        generated = sum(len(o.outputs[0].token_ids) for o in outputs if o.finished) + generated
        if progress and steps % 50 == 0:
            print(f"[throughput] step {steps}: {int(running[-1])} running", flush=True)
    wall = time.perf_counter() - started
    total_out = len(prompts) * output_tokens
    return {
        "kv_capacity_tokens": capacity_tokens(llm),
        "requests": len(prompts),
        "input_tokens": len(prompts[0]),
        "output_tokens": output_tokens,
        "running_max": max(running),
        "running_mean": sum(running) / len(running),
        "preemptions": int(_metric(llm, "vllm:num_preemptions") - preempted_before),
        "engine_steps": steps,
        "output_tokens_finished": generated,
        "output_tok_s": total_out / wall,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an export (python -m quantmla.export)")
    parser.add_argument("--precision", default=None, help="bf16: the backend's BF16 mode")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--input-tokens", type=int, default=3500)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=30_000_000)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--text", required=True, help="text the prompts are cut from")
    parser.add_argument("--json", default=None, help="write the metrics here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from quantmla.serving.engine import build_llm

    prompts = workload_prompts(
        AutoTokenizer.from_pretrained(args.model), args.text, args.requests, args.input_tokens
    )
    llm = build_llm(
        args.model,
        precision=args.precision,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.input_tokens + args.output_tokens,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel,
        disable_log_stats=False,
    )
    metrics = run_workload(llm, prompts, args.output_tokens)
    metrics["precision"] = args.precision or "export"
    print(json.dumps(metrics, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(metrics) + "\n")
    return metrics


if __name__ == "__main__":
    main()
