"""eval.kind=throughput (Fig. 5c): the job's model exported (transforms fused, `quantmla.json`)
and served by vLLM with the QuantMLA backend in the serving venv (`paths.serve_python`, made by
`make serve-setup`): `eval.requests` prompts of `eval.input_tokens` tokens and
`eval.output_tokens` greedy tokens each, submitted at once, at `eval.kv_cache_memory_bytes`.
`precision=bf16` runs the backend's BF16 mode. The record holds vLLM's own numbers
(`quantmla/serving/throughput.py`): KV token capacity, running requests, preemptions, engine steps,
output tokens/s, wall time. On a CPU the tokens/s measure the decode path's speed as much as the
cache pressure; capacity, admitted concurrency and preemptions are the CPU evidence."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from quantmla.errors import ConfigError, QuantMLAError

SHOWN = (
    ("kv_capacity_tokens", "KV tokens", "{:>10,.0f}"),
    ("running_max", "max run", "{:>8.0f}"),
    ("running_mean", "mean run", "{:>9.2f}"),
    ("preemptions", "preempt", "{:>8.0f}"),
    ("recomputed_tokens", "recomputed", "{:>11,.0f}"),
    ("engine_steps", "steps", "{:>7.0f}"),
    ("output_tok_s", "out tok/s", "{:>10.2f}"),
    ("wall_s", "wall s", "{:>8.1f}"),
)


def check(cfg, job) -> None:
    """One line before anything loads: the serving venv, the lengths, the servable cache."""
    from quantmla.serving.settings import check_servable

    e = cfg.eval
    for name in ("requests", "input_tokens", "output_tokens", "max_num_seqs", "tensor_parallel",
                 "max_num_batched_tokens"):  # fmt: skip
        value = getattr(e, name)
        if value is None and name == "max_num_batched_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"eval.{name}", value, "an integer >= 1")
    if isinstance(e.trial, bool) or not isinstance(e.trial, int) or e.trial < 0:
        raise ConfigError("eval.trial", e.trial, "an integer >= 0")
    check_servable(job.paths.serve_python, job.model_config, job.policy, "eval.kind=throughput")
    config = job.model_config
    if config is not None:
        longest = getattr(config, "max_position_embeddings", None)
        if longest and e.input_tokens + e.output_tokens > longest:
            raise ConfigError(
                "eval.input_tokens + eval.output_tokens",
                e.input_tokens + e.output_tokens,
                f"at most the model's max_position_embeddings ({longest})",
            )


def _workload_text(cfg, prepared, folder: Path) -> Path:
    from quantmla.data import load_text

    path = folder / "wikitext2-test.txt"
    path.write_text(load_text("wikitext2", "test", prepared.paths.data_dir))
    return path


def evaluate(cfg, prepared) -> dict:
    from quantmla.checkpoint import write_checkpoint

    e = cfg.eval
    prepared.paths.artifacts_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=prepared.paths.artifacts_dir, prefix="serve-") as tmp:
        folder = Path(tmp)
        export = write_checkpoint(cfg, prepared, folder / "export")
        out = folder / "metrics.json"
        command = [
            str(prepared.paths.serve_python), "-m", "quantmla.serving.throughput",
            "--model", str(export), "--text", str(_workload_text(cfg, prepared, folder)),
            "--requests", str(e.requests), "--input-tokens", str(e.input_tokens),
            "--output-tokens", str(e.output_tokens), "--max-num-seqs", str(e.max_num_seqs),
            "--tensor-parallel", str(e.tensor_parallel), "--dtype", str(cfg.model.dtype),
            "--json", str(out),
        ]  # fmt: skip
        if e.kv_cache_memory_bytes is not None:
            command += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
        if e.max_num_batched_tokens is not None:
            command += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
        if e.first_chunk_admission:
            command.append("--first-chunk-admission")
        if not prepared.policy.spec.quantized:
            command += ["--precision", "bf16"]
        print(f"[throughput] vLLM: {' '.join(command[1:4])} ...", flush=True)
        done = subprocess.run(
            command, cwd=prepared.paths.root, stdout=sys.stdout, stderr=sys.stderr
        )
        if done.returncode or not out.is_file():
            raise QuantMLAError(f"the vLLM throughput run failed (exit {done.returncode})")
        metrics = json.loads(out.read_text())
    metrics.pop("precision", None)
    return {f"throughput/{k}": v for k, v in metrics.items()}


def format_table(record: dict) -> str:
    m = record["metrics"]
    head = "".join(f"{label:>{len(fmt.format(0))}}" for _, label, fmt in SHOWN)
    row = "".join(fmt.format(m[f"throughput/{key}"]) for key, _, fmt in SHOWN)
    return f"{head}\n{row}"
