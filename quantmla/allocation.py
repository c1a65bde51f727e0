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


def best_allocations(errors, sizes, budget: float, precisions, k: int = 1) -> list[Allocation]:
    """The `k` lowest Σ_ℓ errors[ℓ, k_ℓ] subject to Σ_ℓ sizes[k_ℓ] ≤ budget · L, best first, exact:
    the dynamic program keeps the k cheapest partial allocations at every byte count."""
    errors, sizes = np.asarray(errors, float), np.asarray(sizes, np.int64)
    layers, n = errors.shape
    if sizes.shape != (n,) or len(precisions) != n:
        raise ConfigError("allocation candidates", len(precisions), f"{n} formats with their bytes")
    if k < 1:
        raise ConfigError("allocations to keep", k, ">= 1")
    if layers * sizes.min() > budget * layers:
        raise ConfigError(
            "precision.budget_bytes", budget,
            f">= {int(sizes.min())} B/token (the smallest candidate, {precisions[int(sizes.argmin())]})",
        )  # fmt: skip
    unit = reduce(math.gcd, sizes.tolist())
    steps, cap = sizes // unit, int(math.floor(budget * layers / unit + 1e-9))
    cost = np.full((cap + 1, k), np.inf)  # cost[b, r]: the r-th cheapest prefix using b units
    cost[0, 0] = 0.0
    back = []  # per layer: (format, rank of the prefix it extends) of each kept entry
    for layer in range(layers):
        options = np.full((cap + 1, n * k), np.inf)
        for j in range(n):
            if steps[j] <= cap:
                options[steps[j] :, j * k : (j + 1) * k] = (
                    cost[: cap + 1 - steps[j]] + errors[layer, j]
                )
        order = np.argsort(options, axis=1, kind="stable")[:, :k]  # earlier format on ties
        cost = np.take_along_axis(options, order, axis=1)
        back.append((order // k, order % k))
    at, rank = np.nonzero(np.isfinite(cost))
    best = np.lexsort((rank, at, cost[at, rank]))[:k]  # fewest bytes among equal errors
    out = []
    for b, r in zip(at[best].tolist(), rank[best].tolist()):
        picks = []
        for layer in range(layers - 1, -1, -1):
            fmt, prev = back[layer]
            j = int(fmt[b, r])
            picks.append(j)
            b, r = b - int(steps[j]), int(prev[b, r])
        picks.reverse()
        out.append(
            Allocation(
                tuple(precisions[j] for j in picks),
                float(sum(errors[layer, j] for layer, j in enumerate(picks))),
                float(sizes[picks].mean()),
                float(budget),
            )
        )
    return out


def allocate(errors, sizes, budget: float, precisions) -> Allocation:
    """The exact minimum of Σ_ℓ errors[ℓ, k_ℓ] subject to Σ_ℓ sizes[k_ℓ] ≤ budget · L."""
    return best_allocations(errors, sizes, budget, precisions)[0]
