"""The layer sensitivity study (SPEC §7; paper Fig. 2, Fig. 6, Table 4), one record per cell.

For every MLA layer ℓ and path b ∈ {C, P}: perturb only path b's cached values by its own RTN
QDQ error direction rescaled to cache NMSE `eval.target_nmse` (paper 0.01), everything else exact,
and measure the post-`o_proj` output NMSE of that layer fed the BF16 model's own inputs:
R_{b,ℓ} = NMSE_out / NMSE_cache. A job is one cell (dataset × seed, `eval.n_sequences`
non-overlapping windows of `eval.seqlen` tokens); the cell-mean, ratios and envelopes are computed
in `analysis/sensitivity.py` from the records.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from quantmla.evaluation.layer_study import (
    PATH_NAMES,
    capture_cell,
    check_study_config,
    layer_cell,
    peak_memory_mib,
    qdq_error,
    rescale_to_nmse,
    study_layers,
)
from quantmla.evaluation.nmse import nmse


def cell_sequences(cfg, prepared) -> torch.Tensor:
    """The job's cell: `eval.n_sequences` seeded non-overlapping windows of its one dataset."""
    from quantmla.data import load_text, sensitivity_cell, tokenize

    (dataset,) = cfg.eval.datasets
    text = load_text(dataset, cfg.eval.splits[dataset], prepared.paths.data_dir)
    ids = tokenize(text, prepared.tokenizer)
    return sensitivity_cell(ids, cfg.seed, cfg.eval.n_sequences, cfg.eval.seqlen)


@torch.no_grad()
def finite_response(cell, path: str, spec, target: float) -> float:
    """R = NMSE_out / NMSE_cache for path `path` perturbed along its QDQ error at NMSE `target`."""
    x = cell.cached(path)
    e = rescale_to_nmse(qdq_error(spec, path, x), x, target)
    return float(nmse(cell.output(path, x + e), cell.y)) / target


def evaluate(cfg, prepared) -> dict:
    modules, spec = prepared.modules, prepared.policy.spec
    check_study_config(cfg, len(modules))
    layers = study_layers(cfg, len(modules))
    device = modules[0].o_proj.weight.device
    started = time.time()
    with prepared.unquantized():
        store = capture_cell(
            prepared.model, modules, cell_sequences(cfg, prepared), cfg.eval.batch_size
        )
    captured = time.time()
    responses = {path: [] for path in cfg.eval.paths}
    for layer in tqdm(layers, desc="sensitivity", leave=False):
        cell = layer_cell(store, layer, modules[layer], prepared.adapter)
        for path in cfg.eval.paths:
            responses[path].append(finite_response(cell, path, spec, cfg.eval.target_nmse))
    metrics = {f"sensitivity/R_{PATH_NAMES[p]}": r for p, r in responses.items()}
    metrics.update(
        {
            "sensitivity/layers": layers,
            "sensitivity/target_nmse": cfg.eval.target_nmse,
            "sensitivity/seconds_capture": captured - started,
            "sensitivity/seconds_per_layer": (time.time() - captured) / len(layers),
            "sensitivity/peak_memory_mib": peak_memory_mib(device),
        }
    )
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
