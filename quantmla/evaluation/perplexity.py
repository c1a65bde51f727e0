"""Perplexity: mean next-token NLL over every predicted token of non-overlapping windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(
    model, windows: torch.Tensor, batch_size: int = 4, desc: str = "perplexity"
) -> float:
    """exp(Σ NLL / #predicted tokens); each window of L tokens predicts its last L−1 tokens."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in tqdm(windows.split(batch_size), desc=desc, leave=False):
        batch = batch.to(device)
        logits = model(batch).logits[:, :-1]
        nll = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
    return math.exp(total / count)
