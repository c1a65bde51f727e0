"""Per-layer attention-output NMSE of a Table 1 twin's perplexity records (`nmse/attn_layers`):
where each method's error sits across the layers, and in how many layers each is the lowest of
its precision (`python -m analysis.tables layer_nmse --experiment smol_table1`,
`python -m analysis.figures layer_nmse --experiment smol_table1`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.common import pyplot, save
from quantmla.methods.registry import METHODS
from quantmla.spec import parse_precision

METHOD_STYLE = {"rtn": "C7-", "smoothquant": "C2-", "quarot": "C0-", "quantmla": "C3-"}


def layer_errors(records: list[dict]) -> dict[str, dict[str, np.ndarray]]:
    """precision → method → per-layer NMSE, of every quantized cell with per-layer values (one
    model: the records' first; the latest record of a cell; a mixed cache, one format per layer,
    is no precision's row)."""
    found = [r for r in records if r["metrics"].get("nmse/attn_layers")]
    if not found:
        return {}
    model = found[0]["config"]["model"]["name"]
    cells: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    for r in found:
        c = r["config"]
        if c["model"]["name"] != model or c["precision"]["name"] in ("bf16", "mixed"):
            continue
        entry = (r.get("created", ""), np.asarray(r["metrics"]["nmse/attn_layers"], float))
        methods = cells.setdefault(c["precision"]["name"], {})
        if c["method"]["name"] not in methods or entry[0] >= methods[c["method"]["name"]][0]:
            methods[c["method"]["name"]] = entry
    order = [m for m in METHODS if any(m in v for v in cells.values())]
    return {
        p: {m: cells[p][m][1] for m in order if m in cells[p]}
        for p in sorted(cells, key=lambda p: [-b for b in parse_precision(p)])
    }


def _lowest(methods: dict[str, np.ndarray]) -> dict[str, int]:
    """Per method, the layers in which its NMSE is the lowest of the precision's methods."""
    names = list(methods)
    winner = np.argmin(np.stack([methods[m] for m in names]), axis=0)
    return {m: int((winner == i).sum()) for i, m in enumerate(names)}


def layer_rows(records: list[dict]) -> list[list[str]]:
    header = ["precision", "method", "mean NMSE", "median", "largest (layer)",
              "layers lowest", "QuantMLA lower in"]  # fmt: skip
    rows = [header]
    for precision, methods in layer_errors(records).items():
        lowest = _lowest(methods)
        ours = methods.get("quantmla")
        for method, errors in methods.items():
            worst = int(np.argmax(errors))
            versus = (
                "—"
                if ours is None or method == "quantmla"
                else f"{int((ours < errors).sum())} of {len(errors)}"
            )
            rows.append([
                precision.upper(), METHODS[method].label, f"{errors.mean():.3e}",
                f"{np.median(errors):.3e}", f"{errors[worst]:.3e} ({worst})",
                f"{lowest[method]} of {len(errors)}", versus,
            ])  # fmt: skip
    return rows


def fig_layer_nmse(records: list[dict], out: Path, stem: str) -> list[Path]:
    """One panel per quantized precision: each method's attention-output NMSE per layer (log)."""
    plt = pyplot()
    errors = layer_errors(records)
    if not errors:
        raise SystemExit("error: no record with per-layer NMSE (nmse/attn_layers) in these records")
    fig, axes = plt.subplots(1, len(errors), figsize=(5.2 * len(errors), 3.6), squeeze=False)
    for ax, (precision, methods) in zip(axes[0], errors.items()):
        for method, values in methods.items():
            label = f"{METHODS[method].label} (mean {values.mean():.1e})"
            ax.plot(values, METHOD_STYLE.get(method, "-"), marker="o", ms=3, label=label)
        ax.set_yscale("log")
        ax.set_title(precision.upper())
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("attention-output NMSE")
    model = next(
        r["config"]["model"]["name"] for r in records if r["metrics"].get("nmse/attn_layers")
    )
    fig.suptitle(f"Per-layer attention-output NMSE, {model} (the records' NMSE windows)")
    return save(fig, out, stem)
