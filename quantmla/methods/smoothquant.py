"""SmoothQuant† (docs/method.md §4): per-channel scales from 99.9th-percentile statistics, α chosen per path
on held-out normalised attention-output MSE with the other path exact. Also QuantMLA's initialiser.

Choices: scales are normalised to unit geometric mean (s_j = ã_j^−α / geomean(ã^−α)), the content
path's then times the latent's magnitude (`latent_magnitude`: z_C stays at c's scale); the RoPE
statistic of a pair is the 99.9th percentile of the pair's norm √(a²+b²), rotation-invariant,
so the same before and after RoPE.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from quantmla.calibration.context import CalibrationContext
from quantmla.calibration.objectives import content_qdq, layer_output, rope_qdq
from quantmla.config import calibrated_rope_online
from quantmla.methods.base import MethodJob, MethodResult
from quantmla.methods.reuse import reuse_report, with_units
from quantmla.metrics import RunningNMSE
from quantmla.spec import PATHS, QuantizerSpec, layer_spec
from quantmla.transforms import (
    ContentTransform,
    LayerTransforms,
    RopeTransform,
    cached_rope_matrices,
    latent_magnitude,
    online_rope_matrix,
)


def scales_from_statistics(stat: torch.Tensor, alpha: float) -> torch.Tensor:
    """s ∝ max(a, 1e-8)^−α, unit geometric mean (float64)."""
    log_a = stat.double().clamp_min(1e-8).log()
    return torch.exp(-alpha * (log_a - log_a.mean()))


@torch.no_grad()
def heldout_output_nmse(
    ctx: CalibrationContext,
    layer: int,
    spec: QuantizerSpec,
    content=None,
    rope=None,
    batch_size: int = 4,
    batches: list | None = None,
    rope_online: torch.Tensor | None = None,
) -> float:
    """Held-out attention-output NMSE (over all held-out tokens) with the given path(s) quantized;
    `batches`: the held-out (projections, teacher output) of this layer, when already computed;
    `rope_online`: a matrix run online after `rope` (`online_rope_matrix`)."""
    gamma = ctx.gamma(layer)
    layout = ctx.adapter.geometry(ctx.modules[layer]).cache_pairs
    total = RunningNMSE()
    if batches is None:
        batches = [ctx.project(layer, index) for index in ctx.heldout.split(batch_size)]
    for proj, y in batches:
        c, q_rot, k_rot = proj.c, proj.q_rot, proj.k_rot
        if content is not None:
            r, s = content.rotation.to(c), content.scale.to(c)
            c = content_qdq(c, gamma, r, s, spec)
        if rope is not None:
            km, qm = (m.to(k_rot) for m in cached_rope_matrices(rope, layout, rope_online))
            q_rot, k_rot = rope_qdq(q_rot, k_rot, km, qm, spec)
        total.add(
            layer_output(ctx.modules[layer], ctx.adapter, proj, c=c, q_rot=q_rot, k_rot=k_rot), y
        )
    return total.value


def alpha_search(
    ctx: CalibrationContext,
    spec: QuantizerSpec | list[QuantizerSpec],
    alphas,
    batch_size: int = 4,
    skip=frozenset(),
    rope_online: str | None = None,
) -> tuple[list[LayerTransforms], dict]:
    """Per layer (at its own spec, when `spec` is one per layer) and path, the α whose scales give
    the lowest held-out output NMSE (ties → smaller α; the RoPE path's with `rope_online` run after
    its scales). A path left unquantized needs no search (every α leaves the output exact: α 0,
    NMSE 0, no transform); one in `skip` ((layer, path), a unit taken from an earlier artifact)
    gets none here (α and NMSE None)."""
    layers, report = [], {"alpha": [], "heldout_nmse": []}
    online = online_rope_matrix(rope_online, ctx.modules[0].qk_rope_head_dim)
    for layer, module in enumerate(tqdm(ctx.modules, desc="alpha search", leave=False)):
        own = layer_spec(spec, layer)
        best = {p: (0.0, 0.0, None) for p in PATHS if own.path_key(p) is None}
        best |= {p: (None, None, None) for p in PATHS if (layer, p) in skip and p not in best}
        searched = [p for p in PATHS if p not in best]
        if searched:
            statistics = dict(zip(PATHS, ctx.channel_statistics(layer)))
            heldout = [ctx.project(layer, index) for index in ctx.heldout.split(batch_size)]
            magnitude = latent_magnitude(ctx.gamma(layer))
        for path in searched:
            for alpha in sorted(alphas):
                scales = scales_from_statistics(statistics[path], alpha)
                if path == "content":
                    t = ContentTransform(
                        torch.eye(module.kv_lora_rank, dtype=torch.float64),
                        scales * magnitude,
                    )
                    loss = heldout_output_nmse(ctx, layer, own, content=t, batches=heldout)
                else:
                    t = RopeTransform(torch.zeros_like(scales), scales)
                    loss = heldout_output_nmse(
                        ctx, layer, own, rope=t, batches=heldout, rope_online=online
                    )
                if path not in best or loss < best[path][0]:
                    best[path] = (loss, alpha, t)
        layers.append(LayerTransforms(best["content"][2], best["rope"][2]))
        report["alpha"].append({p: best[p][1] for p in PATHS})
        report["heldout_nmse"].append({p: best[p][0] for p in PATHS})
    return layers, report


def smoothquant(job: MethodJob) -> MethodResult:
    cal = job.calibration
    online = calibrated_rope_online(cal)
    layers, report = alpha_search(
        job.context, job.spec, cal.alphas, cal.batch_size, skip=job.fixed.keys(), rope_online=online
    )
    if job.fixed:
        report["reused"] = reuse_report(job.fixed)
    return MethodResult("smoothquant", with_units(layers, job.fixed), online, report=report)
