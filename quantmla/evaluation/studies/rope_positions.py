"""The RoPE key's quantization error by key position (docs/method.md §4): is a method's RoPE path as
accurate on keys past the positions it was calibrated on?

Per MLA layer, the job's cached RoPE key as the cache holds it (after the method's fused transforms
and QuaRot†'s online Hadamard) is quantized at the job's precision, and each key j's error e_j is
scored by every query that reads it: Σ_h Σ_{t ≥ j} (q̃_t · e_j)², normalised by the same sum of
(q̃_t · k̃_j)² — the positional QK error the QuantMLA fit minimises, split over four equal key-position
ranges of `eval.seqlen`. RoPE rotates a pair by an angle that grows with position, so a fixed
per-pair rotation fitted on short sequences meets other phases later; a Hadamard does not depend on
them. One record per method and precision; `python -m analysis.tables rope_positions`.
"""

from __future__ import annotations

import torch

from quantmla.evaluation.studies.layer_study import run_study
from quantmla.metrics import ENERGY_FLOOR
from quantmla.quant import qdq_rope
from quantmla.simulator import layer_patch

BUCKETS = 4


def bucket_edges(seqlen: int) -> list[int]:
    return [seqlen * i // BUCKETS for i in range(BUCKETS + 1)]


def per_key_scored(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, n): Σ_h Σ_{t ≥ j} (q_t · x_j)² for every key j, q (B, H, n, r), x (B, n, r), through the
    queries' suffix Gram matrices Σ_{t ≥ j} q_t q_tᵀ (no (n, n) score matrix)."""
    gram = torch.einsum("bhtr,bhts->btrs", q, q).flip(1).cumsum(1).flip(1)
    return torch.einsum("bjr,bjrs,bjs->bj", x, gram, x)


@torch.no_grad()
def position_errors(cell, spec, edges: list[int]) -> list[float]:
    """The layer's normalised positional QK error in each key-position range."""
    q, k = cell.proj.q_rot.double(), cell.proj.k_rot.double()
    online = layer_patch(cell.module).rope_online
    if online is not None:  # QuaRot†: the cache holds k_R H, the query reads q_R H
        online = online.double()
        q, k = q @ online, k @ online
    error = per_key_scored(q, qdq_rope(spec, k) - k).sum(0)
    energy = per_key_scored(q, k).sum(0)
    return [
        float(error[a:b].sum() / energy[a:b].sum().clamp_min(ENERGY_FLOOR))
        for a, b in zip(edges, edges[1:])
    ]


def evaluate(cfg, prepared) -> dict:
    edges = bucket_edges(cfg.eval.seqlen)
    spec = prepared.policy.spec
    _, results, metrics = run_study(
        cfg, prepared, "rope_positions", lambda cell: position_errors(cell, spec, edges)
    )
    metrics["rope_positions/edges"] = edges
    metrics["rope_positions/qk_error"] = results  # (layers, ranges)
    metrics["rope_positions/mean"] = [
        sum(row[i] for row in results) / len(results) for i in range(BUCKETS)
    ]
    return metrics


def format_table(record: dict) -> str:
    m = record["metrics"]
    edges = m["rope_positions/edges"]
    ranges = [f"keys {a}–{b - 1}" for a, b in zip(edges, edges[1:])]
    lines = ["| layer | " + " | ".join(ranges) + " |", "|---|" + "---|" * len(ranges)]
    for layer, row in zip(m["rope_positions/layers"], m["rope_positions/qk_error"]):
        lines.append(f"| {layer} | " + " | ".join(f"{x:.3e}" for x in row) + " |")
    lines.append("| mean | " + " | ".join(f"{x:.3e}" for x in m["rope_positions/mean"]) + " |")
    return "\n".join(lines)
