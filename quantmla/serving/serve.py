"""`python -m quantmla.serving.serve EXPORT [options] [-- vLLM server options]`: vLLM's own
OpenAI-compatible server over an export, with the QuantMLA backend (registered by the plug-in)
serving the export's cache format. Every refusal the backend would make at start-up is answered
first, in one line; then the process becomes vLLM's server through its supported entry point,
`vllm serve` (run by `quantmla.serving.vllm_cli`, which the CPU build's own `vllm` script needs).

    python -m quantmla.serving.serve exports/tiny --kv-cache-memory-bytes 30000000 --port 8000
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from quantmla.errors import QuantMLAError
from quantmla.serving.platform import PREFIX_CACHING_REFUSED


def server_argv(model_dir: str, host: str, port: int, **engine) -> list[str]:
    """vLLM server arguments for `engine_args(model_dir, **engine)`."""
    from quantmla.serving.engine import engine_args

    args = engine_args(model_dir, **engine)
    argv = ["--model", args.pop("model"), "--host", host, "--port", str(port)]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an export (python -m quantmla.export ... out=DIR)")
    parser.add_argument("--precision", default=None, help="bf16: the backend's BF16 mode")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: vLLM's (lowered to what fits)"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--protection-dtype", default=None, help="bfloat16 (default) | float32 protection rows"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(ours)
    try:
        if "--enable-prefix-caching" in theirs:
            raise QuantMLAError(PREFIX_CACHING_REFUSED)
        command = server_argv(
            args.model, args.host, args.port, precision=args.precision,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, dtype=args.dtype,
            quantmla={"protection_dtype": args.protection_dtype} if args.protection_dtype else None,
        )  # fmt: skip
    except QuantMLAError as err:
        sys.exit(f"error: {err}")
    module = "quantmla.serving.vllm_cli"
    print(f"[quantmla] vllm serve {' '.join(command + theirs)}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", module, "serve", *command, *theirs])


if __name__ == "__main__":
    main()
