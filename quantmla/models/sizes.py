"""Parameter counts and weight bytes of a model from its published config alone (nothing loaded).

The installed transformers class is instantiated on the `meta` device at full depth with one and
with two routed experts; every count is linear in the number of experts, so the real model's count
follows exactly without building hundreds of experts. Parameters are split into the ones an FP8
block-quantized checkpoint (DeepSeek-V3 format) stores as E4M3 with a float32 scale per block —
every projection matrix and routed or shared expert — and the ones it keeps in BF16 (embeddings,
n-gram tables included, `lm_head`, norms, the router). LongCat-Flash-Lite counts as its checkpoint
holds it: n-gram tables and projections, weights for its 256 routed experts, none for the 128
zero-computation ones (quantmla.models.longcat_ngram).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

KEPT_HIGH_PRECISION = (
    "embed_tokens",
    "ngram_embeddings.embedders",  # LongCat-Flash-Lite's n-gram tables: embeddings too
    "lm_head",
    "norm",
    "layernorm",
    "mlp.gate.",
    "router",
    "bias",
)


@dataclass(frozen=True)
class ParamCounts:
    total: int
    fp8_eligible: int  # stored as E4M3 in an FP8 block-quantized checkpoint
    fp8_blocks: int  # 128 × 128 blocks (one float32 scale each) of those matrices
    routed_expert: int  # of `total`, in the routed experts

    def weight_bytes(self, dtype: str, fp8: bool = False) -> int:
        """Bytes of the weights in memory: `dtype` for every parameter, or FP8 storage (1 B per
        eligible parameter + 4 B per block scale, the rest in BF16)."""
        if fp8:
            return self.fp8_eligible + 4 * self.fp8_blocks + 2 * (self.total - self.fp8_eligible)
        return self.total * DTYPE_BYTES[dtype]


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def is_fp8_checkpoint(raw_config: dict) -> bool:
    """A published config.json of an FP8 block-quantized checkpoint (DeepSeek-V3 format)."""
    return (raw_config.get("quantization_config") or {}).get("quant_method") == "fp8"


def fp8_eligible(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and not any(k in name for k in KEPT_HIGH_PRECISION)


def _blocks(shape: tuple[int, ...], block: int = 128) -> int:
    *lead, rows, cols = shape
    return math.prod(lead) * math.ceil(rows / block) * math.ceil(cols / block)


def _count(config) -> tuple[int, int, int, int]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = eligible = blocks = routed = 0
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        total += p.numel()
        if fp8_eligible(name, shape):
            eligible += p.numel()
            blocks += _blocks(shape)
        if ".experts." in name and "shared" not in name:
            routed += p.numel()
    return total, eligible, blocks, routed


def param_counts(config) -> ParamCounts:
    """Exact counts of `config` (a transformers config) as its transformers class builds it."""
    experts = getattr(config, "n_routed_experts", None)
    if not experts:
        return ParamCounts(*_count(config))
    one, two = [], []
    for n, out in ((1, one), (2, two)):
        c = copy.deepcopy(config)
        c.n_routed_experts = n
        for name in ("num_experts_per_tok", "moe_topk"):
            if getattr(c, name, None) is not None:
                setattr(c, name, 1)
        for name in ("n_group", "topk_group"):
            if getattr(c, name, None) is not None:
                setattr(c, name, 1)
        out.extend(_count(c))
    return ParamCounts(*(a + (experts - 1) * (b - a) for a, b in zip(one, two)))


def mla_layer_count(config) -> int:
    """MLA attention layers from a config's fields (LongCat-Flash has two per decoder layer)."""
    if str(getattr(config, "model_type", "")).startswith("longcat_flash"):
        return 2 * config.num_layers
    return config.num_hidden_layers
