"""Cache formats per layer under a bytes budget (issue #23): the allocator, exact.

Layer ℓ cached in format f (a precision: integer bits, FP8 or BF16 per path) is predicted to add
R_{C,ℓ} · NMSE_C(ℓ, f) + R_{P,ℓ} · NMSE_P(ℓ, f) to the output error — the sensitivity study's
responses (output NMSE per unit of cache NMSE) times the format's cache NMSE measured on that
layer's own latents. The allocation minimising the sum over layers with Σ_ℓ bytes(f_ℓ) ≤
budget × layers (bytes per token from the memory model) is a multiple-choice knapsack; with a few
formats and the bytes' common divisor it is solved exactly by dynamic programming over bytes.
Ties go to fewer bytes, then to the earlier format, so the answer is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import reduce

import numpy as np

from quantmla.errors import ConfigError
from quantmla.memory import layout


@dataclass(frozen=True)
class Allocation:
    precisions: tuple[str, ...]  # one per layer
    predicted: float  # Σ_ℓ predicted output NMSE of the chosen formats
    bytes_per_token: float  # mean over layers (the memory model's bytes, no protection)
    budget: float

    def to_dict(self) -> dict:
        return {**asdict(self), "precisions": list(self.precisions)}


def format_bytes(precisions, d_c: int, d_r: int, group_size: int = 64) -> np.ndarray:
    """Bytes per token and layer of each precision in the memory model."""
    return np.array(
        [layout(p, d_c, d_r, group_size=group_size).token_bytes() for p in precisions], np.int64
    )


def predicted_errors(r_content, r_rope, nmse_content, nmse_rope) -> np.ndarray:
    """(L, K): R_{C,ℓ} NMSE_C(ℓ, k) + R_{P,ℓ} NMSE_P(ℓ, k), responses (L,), cache NMSEs (L, K)."""
    rc, rp = np.asarray(r_content, float)[:, None], np.asarray(r_rope, float)[:, None]
    return rc * np.asarray(nmse_content, float) + rp * np.asarray(nmse_rope, float)


def allocate(errors, sizes, budget: float, precisions) -> Allocation:
    """The exact minimum of Σ_ℓ errors[ℓ, k_ℓ] subject to Σ_ℓ sizes[k_ℓ] ≤ budget · L."""
    errors, sizes = np.asarray(errors, float), np.asarray(sizes, np.int64)
    layers, k = errors.shape
    if sizes.shape != (k,) or len(precisions) != k:
        raise ConfigError("allocation candidates", len(precisions), f"{k} formats with their bytes")
    if layers * sizes.min() > budget * layers:
        raise ConfigError(
            "precision.budget_bytes", budget,
            f">= {int(sizes.min())} B/token (the smallest candidate, {precisions[int(sizes.argmin())]})",
        )  # fmt: skip
    unit = reduce(math.gcd, sizes.tolist())
    steps, cap = sizes // unit, int(math.floor(budget * layers / unit + 1e-9))
    cost = np.full(cap + 1, np.inf)
    cost[0] = 0.0
    choice = np.zeros((layers, cap + 1), np.int64)
    for layer in range(layers):
        options = np.full((k, cap + 1), np.inf)
        for j in range(k):
            if steps[j] <= cap:
                options[j, steps[j] :] = cost[: cap + 1 - steps[j]] + errors[layer, j]
        choice[layer] = options.argmin(axis=0)  # first (earlier) format on ties
        cost = options.min(axis=0)
    total = int(np.flatnonzero(cost == cost.min())[0])  # fewest bytes among the optima
    picks, at = [], total
    for layer in range(layers - 1, -1, -1):
        j = int(choice[layer, at])
        picks.append(j)
        at -= int(steps[j])
    picks.reverse()
    return Allocation(
        tuple(precisions[j] for j in picks),
        float(sum(errors[layer, j] for layer, j in enumerate(picks))),
        float(sizes[picks].mean()),
        float(budget),
    )
