"""The operator analysis (docs/method.md §8; paper Tables 5–6, Fig. 7), one record per cell.

For a layer and path b with cached values x_b and output y = f_b(x_b): J_b = ∂y/∂x_b,
H_b = J_bᵀJ_b, D_b = dim x_b (all cached coordinates of the cell). For an error e:
  G_b(e) = ‖J_b e‖² / ‖e‖² (one JVP), T_b = tr(H_b)/D_b, A_b = Σ H_ii e_i² / (T_b ‖e‖²),
  O_b = G_b/T_b − A_b, so that G_b = T_b (A_b + O_b) exactly (O_b carries the off-diagonal part).
tr and diag come from Rademacher probes r in output space, g = J_bᵀ r (VJPs vmapped over a chunk
of probes): tr ≈ mean ‖g‖², diag ≈ mean g ⊙ g. The local study uses each path's QDQ error
direction at cache NMSE `eval.target_nmse` (paper 1e-3). Equal-energy interventions on the
content error: random signs, whole-token permutation (token rows of the cell permuted), isotropic.
Each observed direction also gets its finite-perturbation gain ‖f(x+e) − f(x)‖²/‖e‖², so
`analysis/probes.py` can test the local approximation (Spearman), fit γ and build Tables 5–6.
"""

from __future__ import annotations

import torch
from torch.func import jvp, vjp, vmap

from quantmla.evaluation.studies.layer_study import (
    PATH_NAMES,
    qdq_error,
    rescale_to_nmse,
    run_study,
)

INTERVENTIONS = ("signs", "permutation", "isotropic")


def rademacher(shape, generator, dtype, device) -> torch.Tensor:
    return (torch.randint(0, 2, shape, generator=generator) * 2 - 1).to(dtype=dtype, device=device)


def hessian_diagonal(f, x: torch.Tensor, probes: int, chunk: int, generator) -> torch.Tensor:
    """Rademacher estimate of diag(JᵀJ) of f at x: mean over probes of (Jᵀr)², VJPs vmapped over
    chunks of `chunk` probes (memory grows with the chunk)."""
    y, pullback = vjp(f, x)
    pullback_batched = vmap(lambda r: pullback(r)[0])
    total = torch.zeros_like(x)
    done = 0
    while done < probes:
        k = min(chunk, probes - done)
        r = rademacher((k, *y.shape), generator, y.dtype, y.device)
        total += pullback_batched(r).pow(2).sum(dim=0)
        done += k
    return total / probes


def directional_gain(f, x: torch.Tensor, e: torch.Tensor) -> float:
    """G(e) = ‖J e‖² / ‖e‖², by one JVP."""
    _, je = jvp(f, (x,), (e,))
    return float(je.detach().double().pow(2).sum() / e.double().pow(2).sum())


@torch.no_grad()
def finite_gain(f, x: torch.Tensor, e: torch.Tensor, y: torch.Tensor) -> float:
    """‖f(x + e) − f(x)‖² / ‖e‖²: the finite-perturbation counterpart of G(e)."""
    return float((f(x + e) - y).double().pow(2).sum() / e.double().pow(2).sum())


def decomposition(diag: torch.Tensor, e: torch.Tensor, gain: float) -> dict[str, float]:
    """T, A, O of G = T (A + O) from diag(H) and the error e (float64)."""
    d, e2 = diag.double(), e.double().pow(2)
    trace_mean = float(d.mean())
    allocation = float((d * e2).sum() / (trace_mean * e2.sum()))
    return {"T": trace_mean, "A": allocation, "O": gain / trace_mean - allocation}


def intervene(kind: str, e: torch.Tensor, generator) -> torch.Tensor:
    """An equal-energy variant of the error e (B, n, d)."""
    if kind == "signs":
        return e * rademacher(e.shape, generator, e.dtype, e.device)
    if kind == "permutation":
        rows = e.reshape(-1, e.shape[-1])
        order = torch.randperm(rows.shape[0], generator=generator).to(e.device)
        return rows[order].reshape(e.shape)
    iso = torch.randn(e.shape, generator=generator).to(e)
    return iso * (e.double().norm() / iso.double().norm()).to(e.dtype)


def study_layer(cell, spec, cfg, generator) -> dict:
    """Everything the operator analysis records for one layer of one cell."""
    ev = cfg.eval
    out: dict = {"observations": [], "interventions": {k: [] for k in INTERVENTIONS}}
    for path in ev.paths:
        x = cell.cached(path).detach()

        def f(v, path=path):
            return cell.output(path, v)

        e = rescale_to_nmse(qdq_error(spec, path, x), x, ev.target_nmse)
        gain = directional_gain(f, x, e)
        # J is block-diagonal over the cell's sequences: probe each block on its own (same
        # estimator, a fraction of the memory)
        diag = torch.cat(
            [
                hessian_diagonal(
                    lambda v, s=s, path=path: cell.sequences(slice(s, s + 1)).output(path, v),
                    x[s : s + 1],
                    ev.probes,
                    ev.probe_chunk,
                    generator,
                )
                for s in range(x.shape[0])
            ]
        )
        name = PATH_NAMES[path]
        for key, value in decomposition(diag, e, gain).items():
            out[f"{key}_{name}"] = value
        out[f"G_{name}"] = gain
        out[f"Gfd_{name}"] = finite_gain(f, x, e, cell.y)
        out["observations"].append([name, "qdq", gain, out[f"Gfd_{name}"]])
        kinds = INTERVENTIONS if path == "C" else ("isotropic",)
        for kind in kinds:
            ratios = []
            for draw in range(ev.interventions):
                e_alt = intervene(kind, e, generator)
                g_alt = directional_gain(f, x, e_alt)
                ratios.append(g_alt / gain)
                if draw == 0:
                    out["observations"].append(
                        [name, kind, g_alt, finite_gain(f, x, e_alt, cell.y)]
                    )
            if path == "C":
                out["interventions"][kind] = ratios
    return out


def evaluate(cfg, prepared) -> dict:
    generator = torch.Generator().manual_seed(cfg.seed)
    # derivatives are taken w.r.t. cached values only; weights needing grad would make every
    # vmapped VJP keep a graph through them (gigabytes on the tiny model)
    for p in prepared.model.parameters():
        p.requires_grad_(False)
    spec = prepared.policy.spec
    _, per_layer, metrics = run_study(
        cfg, prepared, "probes", lambda cell: study_layer(cell, spec, cfg, generator)
    )
    for key in (k for k in per_layer[0] if k not in ("observations", "interventions")):
        metrics[f"probes/{key}"] = [row[key] for row in per_layer]
    metrics["probes/observations"] = [row["observations"] for row in per_layer]
    for kind in INTERVENTIONS:
        metrics[f"probes/ratio_{kind}"] = [row["interventions"][kind] for row in per_layer]
    metrics["probes/n_probes"] = cfg.eval.probes
    return metrics


def format_table(record: dict) -> str:
    m = record["metrics"]
    lines = [
        "| layer | G_C | G_P | T_C | T_P | A_C | A_P | O_C | O_P |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, layer in enumerate(m["probes/layers"]):
        cells = [
            m.get(f"probes/{k}_{p}", [None] * (i + 1))[i]
            for k in ("G", "T", "A", "O")
            for p in ("content", "rope")
        ]
        lines.append(
            f"| {layer} | " + " | ".join("—" if v is None else f"{v:.4g}" for v in cells) + " |"
        )
    return "\n".join(lines)
