"""What the two testbed trainers share: the dense-MLA model fields, the training text, AdamW with
decay only on matrices, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantmla.data import load_documents


@dataclass
class TinyModelConfig:
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048


def training_documents(data_dir: str | None) -> list[str]:
    """C4 train slice (never its eval slice) and GSM8K train: the only text the testbeds see."""
    return load_documents("c4", "train", data_dir) + load_documents("gsm8k", "train", data_dir)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (β = 0.9, 0.95) with weight decay on matrices only (not norms or biases)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )


def warmup_cosine(step: int, peak: float, warmup: int, horizon: int, min_ratio: float) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to `min_ratio`·peak at
    `horizon` (held there after)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
