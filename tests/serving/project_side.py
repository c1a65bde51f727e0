"""Reference numbers from the project's own venv (transformers 5.24, the simulator), for the
serving tests that run in .venv-serve: `python tests/serving/project_side.py logprobs ...`.

Prints JSON: the log-probability of each token given the tokens before it (teacher-forced), under
transformers' fp32 model (`--precision bf16`: no cache quantization) or the simulator."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def logprobs(model_dir: str, ids: list[int], precision: str, sink: int, recent: int) -> list:
    from quantmla import patch_model
    from quantmla.models.loading import load_pretrained

    model, _ = load_pretrained(model_dir, dtype="float32")
    if precision != "bf16":
        patch_model(model, precision, sink=sink, recent=recent)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["logprobs"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True, help="JSON file with a list of token ids")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--recent", type=int, default=128)
    args = parser.parse_args()
    ids = json.loads(Path(args.ids).read_text())
    torch.set_num_threads(2)
    print(json.dumps(logprobs(args.model, ids, args.precision, args.sink, args.recent)))


if __name__ == "__main__":
    main()
