"""Fig. 5c's workload under vLLM's own scheduler: N requests of `input_tokens` prompt tokens and
`output_tokens` greedy tokens, all submitted at once, at a fixed KV budget, BF16 mode vs the
export's packed cache. Run in the serving venv:

    python -m quantmla.serving.throughput --model DIR [--precision bf16] --json OUT

Each step of the engine is driven here so the record holds vLLM's own numbers per step: KV
token capacity, running requests (max and mean over steps), preemptions, the tokens its steps
computed beyond one pass over every prompt and output (recomputed after preemption), engine
steps, output tokens per second and wall time. vLLM's own scheduler settings are kept (chunked
prefill on at its default batch; prefix caching off, quantmla/serving/platform.py) and recorded. Prompts are consecutive WikiText-2 test tokens (one offset per
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
    """A counter's or gauge's value, summed over vLLM's engines."""
    return sum(float(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name == name)


def _count_scheduled_tokens(engine) -> list[int]:
    """A one-element counter of the tokens vLLM's scheduler gives the model each step (prompt
    chunks, recomputed ones included, and decode tokens): its own `SchedulerOutput`s, read on the
    in-process engine core."""
    core = getattr(engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the throughput workload drives an in-process engine core")
    scheduler, count = core.scheduler, [0]
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        output = schedule(*args, **kwargs)
        count[0] += output.total_num_scheduled_tokens
        return output

    scheduler.schedule = counted
    return count


def run_workload(llm, prompts: list[list[int]], output_tokens: int, progress: bool = True) -> dict:
    """Submit every request, step the engine until all finish; vLLM's own counters."""
    from vllm import SamplingParams

    from quantmla.serving.engine import capacity_tokens

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    preempted_before = _metric(llm, "vllm:num_preemptions")
    computed = _count_scheduled_tokens(engine)
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
    computed = computed[0]
    # one pass: every prompt token and every output token but the last (never fed back)
    once = sum(len(ids) for ids in prompts) + len(prompts) * (output_tokens - 1)
    config = engine.vllm_config
    return {
        "chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "reserve_full_isl": bool(
            getattr(config.scheduler_config, "scheduler_reserve_full_isl", False)
        ),
        "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "computed_tokens": int(computed),
        "recomputed_tokens": int(computed - once),
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
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: vLLM's (chunked prefill)"
    )
    parser.add_argument(
        "--first-chunk-admission", action="store_true",
        help="admit a request when its first chunk fits (scheduler_reserve_full_isl=False: the "
        "policy before vLLM reserved the whole prompt at admission), not its whole prompt",
    )  # fmt: skip
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
        **({"max_num_batched_tokens": args.max_num_batched_tokens}
           if args.max_num_batched_tokens else {}),
        **({"scheduler_reserve_full_isl": False} if args.first_chunk_admission else {}),
    )  # fmt: skip
    metrics = run_workload(llm, prompts, args.output_tokens)
    metrics["precision"] = args.precision or "export"
    print(json.dumps(metrics, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(metrics) + "\n")
    return metrics


if __name__ == "__main__":
    main()
