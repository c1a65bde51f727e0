"""Write a tiny random-init twin of LongCat-Flash-Lite in its published checkpoint format: the
published config shrunk in layers (2 decoder layers = 4 MLA blocks), heads (16), experts (4 routed +
2 zero-computation), FFN widths, vocabulary (the tiny testbed's 4,096 tokens, whose tokenizer is
saved beside it) and n-gram rows (ratio 1) — MLA dims, hidden size and the n-gram geometry (orders
2–4, 4 splits, 12 tables of 256) kept. Keys as published: per-expert weights, n-gram tables and
projections under `model.ngram_embeddings`.

    python -m experiments.make_longcat_lite_twin OUT
    python -m quantmla.run model=longcat_flash_lite model.path=OUT model.device=cpu model.dtype=float32 ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from quantmla.models.loading import config_from_file, shrink_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "assets" / "model-configs" / "longcat-flash-lite.json"
TOKENIZER = REPO / "assets" / "tiny-mla"


def tiny_lite(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    heads: int = 16,
    ffn_size: int = 256,
    experts_implementation: str | None = None,
):
    """The twin (random init, `seed`) and its tokenizer (the tiny testbed's: vocabulary, EOS).
    `experts_implementation="eager"` runs the experts in float64 (tests)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    config = shrink_config(
        config_from_file(CONFIG),
        num_layers=4,
        vocab_size=len(tokenizer),
        max_heads=heads,
        n_experts=4,
        ffn_size=ffn_size,
        dtype=dtype,
        ngram_ratio=1,
    )
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra).eval()
    return model, tokenizer


def write_twin(out: Path, seed: int = 0) -> Path:
    model, tokenizer = tiny_lite(seed)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write_twin(Path(args.out), args.seed)}")


if __name__ == "__main__":
    main()
