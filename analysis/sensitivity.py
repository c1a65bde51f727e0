"""Aggregates of the sensitivity study (docs/method.md §7) from its per-cell records: Table 4, Fig. 2, Fig. 6.

Per model: R̄_{b,ℓ} = mean over cells of R_{b,ℓ}; min/max cell envelopes; layer ratio
r_ℓ = R̄_{P,ℓ} / R̄_{C,ℓ}; model ratio = mean_ℓ R̄_P / mean_ℓ R̄_C (not the mean of r_ℓ);
median and interquartile range of r_ℓ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.common import MODEL_ORDER, cell, pyplot, save


@dataclass
class ModelSensitivity:
    model: str
    layers: list[int]
    cells: list[str]
    content: np.ndarray  # (cells, layers) R_C
    rope: np.ndarray  # (cells, layers) R_P

    @property
    def mean_content(self) -> np.ndarray:
        return self.content.mean(axis=0)

    @property
    def mean_rope(self) -> np.ndarray:
        return self.rope.mean(axis=0)

    @property
    def layer_ratio(self) -> np.ndarray:
        return self.mean_rope / self.mean_content

    @property
    def model_ratio(self) -> float:
        return float(self.mean_rope.mean() / self.mean_content.mean())


def aggregate(records: list[dict]) -> list[ModelSensitivity]:
    """One entry per model (paper order first), cells sorted, only layers every cell has."""
    by_model: dict[str, list[dict]] = {}
    for r in records:
        if "sensitivity/R_content" in r["metrics"] and "sensitivity/R_rope" in r["metrics"]:
            by_model.setdefault(r["config"]["model"]["name"], []).append(r)
    order = sorted(
        by_model,
        key=lambda m: (m not in MODEL_ORDER, MODEL_ORDER.index(m) if m in MODEL_ORDER else 0, m),
    )
    out = []
    for model in order:
        rows = sorted(by_model[model], key=cell)
        layers = sorted(set.intersection(*(set(r["metrics"]["sensitivity/layers"]) for r in rows)))

        def matrix(key, rows=rows, layers=layers):
            picked = []
            for r in rows:
                index = {layer: i for i, layer in enumerate(r["metrics"]["sensitivity/layers"])}
                picked.append([r["metrics"][key][index[layer]] for layer in layers])
            return np.array(picked, dtype=float)

        out.append(
            ModelSensitivity(
                model,
                layers,
                [cell(r) for r in rows],
                matrix("sensitivity/R_content"),
                matrix("sensitivity/R_rope"),
            )
        )
    return out


def table4_rows(records: list[dict]) -> list[list[str]]:
    """Table 4: model-level aggregates (the paper's own Table 4 values did not survive extraction)."""
    header = [
        "model",
        "layers",
        "cells",
        "mean R̄_C",
        "mean R̄_P",
        "model ratio",
        "median r_ℓ",
        "IQR r_ℓ",
        "layers with r_ℓ > 1",
    ]
    rows = [header]
    for m in aggregate(records):
        r = m.layer_ratio
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        rows.append(
            [
                m.model,
                str(len(m.layers)),
                str(len(m.cells)),
                f"{m.mean_content.mean():.4g}",
                f"{m.mean_rope.mean():.4g}",
                f"**{m.model_ratio:.3f}**",
                f"{med:.3f}",
                f"{q1:.3f}–{q3:.3f}",
                f"{int((r > 1).sum())}/{len(r)}",
            ]
        )
    return rows


def fig2(records: list[dict], out: Path, stem: str) -> list:
    """Per model: R̄_C and R̄_P by layer with min/max cell envelopes; last panel: median r_ℓ
    (diamond) and IQR (whisker) per model, with the model ratio."""
    plt = pyplot()
    models = aggregate(records)
    fig, axes = plt.subplots(
        1, len(models) + 1, figsize=(4 * (len(models) + 1), 3.4), squeeze=False
    )
    for ax, m in zip(axes[0], models):
        for values, mean, color, label in (
            (m.content, m.mean_content, "C0", "content R̄_C"),
            (m.rope, m.mean_rope, "C3", "RoPE R̄_P"),
        ):
            ax.fill_between(
                m.layers, values.min(axis=0), values.max(axis=0), color=color, alpha=0.2
            )
            ax.plot(m.layers, mean, "-o", color=color, markersize=3, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("MLA layer")
        ax.set_ylabel("finite response R = NMSE_out / NMSE_cache")
        ax.set_title(f"{m.model} (model ratio {m.model_ratio:.2f})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    summary = axes[0][-1]
    for i, m in enumerate(models):
        q1, med, q3 = np.percentile(m.layer_ratio, [25, 50, 75])
        summary.plot([i, i], [q1, q3], "k-")
        summary.plot([i], [med], "kD", markersize=6)
        summary.plot([i], [m.model_ratio], "C3o", markersize=5)
    summary.axhline(1.0, color="gray", lw=0.8, ls="--")
    summary.set_xticks(range(len(models)), [m.model for m in models], rotation=30, fontsize=7)
    summary.set_ylabel("r_ℓ = R̄_P / R̄_C")
    summary.set_title("◆ median r_ℓ, bar IQR, ● model ratio", fontsize=9)
    summary.grid(alpha=0.3)
    fig.suptitle("Fig. 2 — path sensitivity at cache NMSE 0.01 (shaded: min–max over cells)", y=1.0)
    return save(fig, out, stem)


def fig6(records: list[dict], out: Path, stem: str) -> list:
    """Every layer's ratio r_ℓ, models side by side (the paper's 285-layer view)."""
    plt = pyplot()
    models = aggregate(records)
    fig, ax = plt.subplots(figsize=(max(6, 0.06 * sum(len(m.layers) for m in models) + 4), 3.4))
    start = 0
    for i, m in enumerate(models):
        x = np.arange(start, start + len(m.layers))
        ax.bar(x, m.layer_ratio, color=f"C{i}", label=m.model, width=0.9)
        start += len(m.layers) + 2
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_ylabel("r_ℓ = R̄_P / R̄_C")
    ax.set_xlabel("MLA layers, by model")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Fig. 6 — layer-wise RoPE/content sensitivity ratio, all layers")
    return save(fig, out, stem)
