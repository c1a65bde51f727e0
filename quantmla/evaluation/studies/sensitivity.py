"""The layer sensitivity study (docs/method.md §7; paper Fig. 2, Fig. 6, Table 4), one record per cell.

For every MLA layer ℓ and path b ∈ {C, P}: perturb only path b's cached values by its own RTN
QDQ error direction rescaled to cache NMSE `eval.target_nmse` (paper 0.01), everything else exact,
and measure the post-`o_proj` output NMSE of that layer fed the BF16 model's own inputs:
R_{b,ℓ} = NMSE_out / NMSE_cache. A job is one cell (dataset × seed, `eval.n_sequences`
non-overlapping windows of `eval.seqlen` tokens); the cell-mean, ratios and envelopes are computed
in `analysis/sensitivity.py` from the records.
"""

from __future__ import annotations

import torch

from quantmla.evaluation.studies.layer_study import (
    PATH_NAMES,
    qdq_error,
    rescale_to_nmse,
    run_study,
)
from quantmla.metrics import nmse


@torch.no_grad()
def finite_response(cell, path: str, spec, target: float) -> float:
    """R = NMSE_out / NMSE_cache for path `path` perturbed along its QDQ error at NMSE `target`."""
    x = cell.cached(path)
    e = rescale_to_nmse(qdq_error(spec, path, x), x, target)
    return float(nmse(cell.output(path, x + e), cell.y)) / target


def evaluate(cfg, prepared) -> dict:
    spec, paths, target = prepared.policy.spec, cfg.eval.paths, cfg.eval.target_nmse
    _, results, metrics = run_study(
        cfg,
        prepared,
        "sensitivity",
        lambda cell: [finite_response(cell, path, spec, target) for path in paths],
    )
    for i, path in enumerate(paths):
        metrics[f"sensitivity/R_{PATH_NAMES[path]}"] = [row[i] for row in results]
    return metrics


def format_table(record: dict) -> str:
    m = record["metrics"]
    rc, rp = m.get("sensitivity/R_content"), m.get("sensitivity/R_rope")
    lines = ["| layer | R_content | R_rope | R_rope / R_content |", "|---|---|---|---|"]
    for i, layer in enumerate(m["sensitivity/layers"]):
        c = rc[i] if rc else None
        p = rp[i] if rp else None
        ratio = f"{p / c:.3f}" if c and p is not None else "—"
        lines.append(
            f"| {layer} | {'—' if c is None else f'{c:.4g}'} | {'—' if p is None else f'{p:.4g}'} | {ratio} |"
        )
    if rc and rp:
        lines.append(
            f"model ratio mean R_rope / mean R_content = {sum(rp) / sum(rc):.3f} (this cell)"
        )
    return "\n".join(lines)
