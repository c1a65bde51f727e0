"""Write a tiny FP8 checkpoint in the published DeepSeek-V3 format from a random-init model of
DeepSeek-V3's config (real MLA dims: d_c 512, d_r 64, q_lora 1536; fewer layers, experts, heads and
a narrower hidden size): E4M3 weights + `weight_scale_inv` per 128 × 128 block for every projection,
BF16 for embeddings, lm_head, norms and the router, `quantization_config` in config.json.

    python -m experiments.make_fp8_checkpoint OUT [--reference REF]

`--reference` also saves the BF16 model it was quantized from (for comparisons)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantmla.models.fp8 import FP8_CONFIG, fp8_eligible, quantize_blocks
from quantmla.models.loading import config_from_file, shrink_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "assets" / "model-configs" / "deepseek-v3-base.json"


def tiny_v3(seed: int = 0):
    from transformers import AutoModelForCausalLM

    config = shrink_config(
        config_from_file(CONFIG),
        num_layers=2,
        vocab_size=512,
        max_heads=4,
        n_experts=4,
        ffn_size=256,
    )
    config.hidden_size = 1024
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def write_fp8(model, out: Path) -> Path:
    """Save `model`, then rewrite its weights file with every eligible matrix as E4M3 + scales."""
    model.save_pretrained(out, safe_serialization=True)
    (weights,) = out.glob("*.safetensors")
    tensors = {}
    for name, w in load_file(str(weights)).items():
        if fp8_eligible(name, w.shape):
            q, scale_inv = quantize_blocks(w)
            tensors[name] = q
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale_inv
        else:
            tensors[name] = w
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--reference", default=None, help="also save the BF16 model here")
    args = parser.parse_args()
    model = tiny_v3()
    if args.reference:
        model.save_pretrained(args.reference, safe_serialization=True)
    print(f"wrote {write_fp8(model, Path(args.out))}")


if __name__ == "__main__":
    main()
