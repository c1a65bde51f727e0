"""Where held-out retrieval fails: teacher-forced accuracy per answer position (#13).

`python -m experiments.retrieval_diagnosis --model assets/tiny-mla-v2 --length 256 --n 100`
prints, for the evaluation's held-out phrasings and for training phrasings on the same filler
haystack and 7-digit values, the argmax hits at each answer position (0 = the value's first token:
the lookup; later = copying; the last = EOS) and the documents answered whole."""

from __future__ import annotations

import argparse
import random

import torch


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.data.retrieval import RetrievalSampler, heldout_phrasing, training_phrasing
    from quantmla.evaluation.retrieval import VALUE_STYLE, answer_token_hits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local checkpoint folder")
    parser.add_argument("--length", type=int, default=1024, help="document length in tokens")
    parser.add_argument("--n", type=int, default=60, help="documents per phrasing kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    sampler = RetrievalSampler(tokenizer)
    for name, phrasing in (("held-out", heldout_phrasing), ("training", training_phrasing)):
        rng = random.Random(args.seed * 1_000_003 + args.length)
        docs = [sampler.sample(args.length, rng, phrasing, VALUE_STYLE) for _ in range(args.n)]
        hits, totals, whole = answer_token_hits(model, docs)
        per_position = " ".join(f"{h}/{t}" for h, t in zip(hits, totals))
        print(
            f"{name:9s} {args.length:5d} tokens: whole {whole}/{args.n}; per position {per_position}"
        )


if __name__ == "__main__":
    main()
