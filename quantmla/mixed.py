"""A job's mixed allocation (`precision=mixed`, issue #23): each MLA layer's cache format, chosen
by the exact allocator (`quantmla.allocation`) from the model's sensitivity records (R_C, R_P per
layer, the mean over their cells) and every candidate format's cache NMSE on that layer's own
latents (WikiText-2 valid windows through the BF16 model). Methods then calibrate each layer at
its chosen format; the record carries the choice, its prediction and every input."""

from __future__ import annotations

import numpy as np
import torch

from quantmla.allocation import (
    Allocation,
    allocate,
    format_bytes,
    measure_format_nmse,
    predicted_errors,
)
from quantmla.calibration.context import CalibrationContext
from quantmla.errors import ConfigError, DataNotFoundError
from quantmla.models.capture import capture_inputs
from quantmla.tracking.store import load_records


def sensitivity_responses(job) -> tuple[np.ndarray, np.ndarray, int]:
    """(R̄_C, R̄_P) per layer, means over the cells of the job's sensitivity records (same model
    path and weights, every layer), and the number of cells; one line if there are none."""
    p, model = job.cfg.precision, job.cfg.model
    found = [
        r
        for r in load_records(job.paths.results_dir, p.sensitivity_experiment)
        if r["config"]["eval"]["kind"] == "sensitivity"
        and r["config"]["model"]["path"] == model.path
        and r["config"]["model"].get("weights") == job.weights
        and not r["config"]["eval"].get("layers")  # every layer
    ]
    if not found:
        raise DataNotFoundError(
            f"precision=mixed reads R_C, R_P from sensitivity records: none for model.path={model.path!r} "
            f"(these weights, every layer) in {job.paths.results_dir / p.sensitivity_experiment}; run "
            f"`python -m quantmla.run eval=sensitivity model={model.name} experiment_name={p.sensitivity_experiment}` "
            "or set precision.sensitivity_experiment"
        )
    rc = np.mean([r["metrics"]["sensitivity/R_content"] for r in found], axis=0)
    rp = np.mean([r["metrics"]["sensitivity/R_rope"] for r in found], axis=0)
    return rc, rp, len(found)


def check(job) -> None:
    """Before anything loads: the candidates, the budget against them, the sensitivity records."""
    p, policy = job.cfg.precision, job.policy
    if p.budget_bytes is None:
        raise ConfigError(
            "precision.budget_bytes", None, "mean bytes per token and layer, e.g. 192"
        )
    if not p.candidates:
        raise ConfigError(
            "precision.candidates", p.candidates, "one or more formats, e.g. [c2r4, c4r4, bf16]"
        )
    if "mixed" in p.candidates:
        raise ConfigError("precision.candidates", "mixed", "single formats")
    config = job.model_config
    for name in p.candidates:
        layer = policy.layer(name)  # validates the format
        if config is not None:
            layer.check_dims(config.kv_lora_rank, config.qk_rope_head_dim)
    if p.allocation_windows < 1:
        raise ConfigError("precision.allocation_windows", p.allocation_windows, ">= 1")
    if config is not None:
        sizes = format_bytes(
            p.candidates, config.kv_lora_rank, config.qk_rope_head_dim, p.group_size
        )
        if sizes.min() > p.budget_bytes:
            raise ConfigError(
                "precision.budget_bytes",
                p.budget_bytes,
                f">= {int(sizes.min())} (the smallest candidate, {p.candidates[int(sizes.argmin())]})",
            )
    sensitivity_responses(job)


@torch.no_grad()
def latent_nmse(model, adapter, modules, sequences, candidates, group_size: int):
    """Cache NMSE of every candidate on each layer's own c and k_R: ((L, K) content, (L, K) RoPE)."""
    store = capture_inputs(model, modules, sequences)
    ctx = CalibrationContext(
        model, adapter, modules, store, torch.arange(sequences.shape[0]), torch.arange(0)
    )
    content, rope = [], []
    for layer in range(len(modules)):
        proj, _ = ctx.project(layer, ctx.calibration)
        c, k = proj.c.flatten(0, 1).float().cpu(), proj.k_rot.flatten(0, 1).float().cpu()
        nc, nr = measure_format_nmse([(c, k)], candidates, group_size)
        content.append(nc[0])
        rope.append(nr[0])
    return np.array(content), np.array(rope)


def allocate_for_job(job, model, adapter, modules, tokenizer) -> tuple[Allocation, dict]:
    """The allocation of a `precision=mixed` job on its (BF16-patched) model, and what it used."""
    from quantmla.data import load_text, perplexity_windows, tokenize

    cfg, p = job.cfg, job.cfg.precision
    geometries = {(g.d_c, g.d_r) for g in map(adapter.geometry, modules)}
    if len(geometries) != 1:
        raise ConfigError("precision", "mixed", "a model whose MLA layers share d_c and d_r")
    (d_c, d_r), candidates = geometries.pop(), list(p.candidates)
    rc, rp, cells = sensitivity_responses(job)
    if len(rc) != len(modules):
        raise ConfigError(
            "precision.sensitivity_experiment", p.sensitivity_experiment,
            f"records with {len(modules)} layers (they have {len(rc)})",
        )  # fmt: skip
    ids = tokenize(load_text("wikitext2", "valid", job.paths.data_dir), tokenizer)
    windows = perplexity_windows(ids, cfg.model.eval_seqlen, p.allocation_windows)
    nc, nr = latent_nmse(model, adapter, modules, windows, candidates, p.group_size)
    sizes = format_bytes(candidates, d_c, d_r, p.group_size)
    errors = predicted_errors(rc, rp, nc, nr)
    allocation = allocate(errors, sizes, p.budget_bytes, candidates)
    print(
        f"[quantmla] mixed allocation at {p.budget_bytes:g} B/token: {', '.join(allocation.precisions)} "
        f"({allocation.bytes_per_token:g} B/token, predicted Σ output NMSE {allocation.predicted:.3e})"
    )
    report = {
        "candidates": candidates,
        "candidate_bytes": sizes.tolist(),
        "r_content": rc.tolist(),
        "r_rope": rp.tolist(),
        "sensitivity_cells": cells,
        "cache_nmse_content": nc.tolist(),
        "cache_nmse_rope": nr.tolist(),
        "predicted_errors": errors.tolist(),
        "nmse_windows": int(windows.shape[0]),
    }
    return allocation, report
