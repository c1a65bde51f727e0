"""vLLM's own load client (`vllm bench serve`: random dataset, the export's tokenizer) against an
export served by `python -m quantmla.serving.serve` on 127.0.0.1 under vLLM's defaults (chunked
prefill on), BF16 mode and the export's format one after the other; prints vLLM's tables and keeps
its JSON results. Serving venv; bounded: one server at a time, a fixed number of prompts.

    .venv-serve/bin/python benchmarks/vllm_bench_serve.py exports/v2-c4r4 \\
        [--kv-cache-memory-bytes 30000000] [--num-prompts 32] [--out results/bench/vllm_bench_serve]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(export: str, port: int, precision: str | None, kv_bytes: int, log: Path):
    command = [sys.executable, "-m", "quantmla.serving.serve", export, "--port", str(port),
               "--kv-cache-memory-bytes", str(kv_bytes), "--dtype", "float32"]  # fmt: skip
    if precision:
        command += ["--precision", precision]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not come up within 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=30_000_000)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--out", default="results/bench/vllm_bench_serve")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for precision in ("bf16", None):
        name = precision or "export"
        port = free_port()
        proc = serve(args.export, port, precision, args.kv_cache_memory_bytes, out / f"{name}.log")
        try:
            subprocess.run(
                [sys.executable, "-m", "quantmla.serving.vllm_cli", "bench", "serve",
                 "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
                 "--model", args.export, "--tokenizer", args.export,
                 "--dataset-name", "random", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len), "--num-prompts",
                 str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                 "--seed", "0", "--save-result", "--result-dir", str(out),
                 "--result-filename", f"{name}.json"],
                check=True, timeout=1800,
            )  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
